#!/usr/bin/env python3
"""The runs on the shared file system, as JSON: what `jobs`, `logs` and `cancel` know of past jobs.

Runs on the login node (stdlib only): `python3 - RUNS_DIR [--job ID | --run RUN] [--limit N] < list_runs.py`.
Slurm forgets a job minutes after it ends (there is no accounting database); each run directory
keeps what the operator needs: job.json (the request), job_id, status.json (the exit, written by the
job), verdict.json (which rank failed), run.json (node-hours and estimated cost), slow_ranks.json (the
ranks of the running attempt that compute persistently slower than the others). Directories the
caller cannot read (other users' runs, mode 0700) are listed by name and owner alone, readable false:
what the file system lets anyone see of them.
"""

import argparse
import json
import os
import pwd
import stat
import sys


def _read_json(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _read_text(path):
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _current_slow_ranks(run_dir):
    """slow_ranks.json, unless it is older than the attempt now running (a requeued job whose rank 0 has not
    started yet: the last attempt's verdict, about nodes this one may not have)."""
    path = os.path.join(run_dir, "slow_ranks.json")
    document = _read_json(path)
    started = (_read_text(os.path.join(run_dir, "attempts.started")) or "").splitlines()
    try:
        attempt_start = int(started[-1].split()[1]) if started else 0
        if document is None or os.stat(path).st_mtime < attempt_start:
            return None
    except (OSError, ValueError, IndexError):
        return None
    return document


def _owner(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a person removed from the cluster: their runs stay
        return str(uid)


def describe(runs_dir, name):
    run_dir = os.path.join(runs_dir, name)
    try:
        info = os.stat(run_dir)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return None
    entry = {"run_id": name, "run_dir": run_dir, "owner": _owner(info.st_uid), "modified": info.st_mtime}
    if not os.access(run_dir, os.R_OK | os.X_OK):
        unread = dict.fromkeys(("job_id", "job", "status", "verdict", "record", "slow_ranks"))
        return {**entry, **unread, "readable": False}
    job = _read_json(os.path.join(run_dir, "job.json"))
    if job is None:
        return None
    return {
        **entry,
        "readable": True,
        "job_id": _read_text(os.path.join(run_dir, "job_id")),
        "job": job,
        "status": _read_json(os.path.join(run_dir, "status.json")),
        "verdict": _read_json(os.path.join(run_dir, "verdict.json")),
        "record": _read_json(os.path.join(run_dir, "run.json")),
        "slow_ranks": _current_slow_ranks(run_dir),
    }


def list_runs(runs_dir, job=None, run=None, limit=20, also=()):
    """The newest runs (at most limit), or just one (job, run); also: these runs too, however old (the
    running jobs', whose directories may be older than the newest runs)."""
    try:
        names = [run] if run else os.listdir(runs_dir)
    except OSError:
        return []
    found = _described(runs_dir, names, job)
    found.sort(key=lambda entry: entry["modified"], reverse=True)
    found = found[:limit]
    listed = {entry["run_id"] for entry in found}
    return found + _described(runs_dir, [name for name in dict.fromkeys(also) if name not in listed], None)


def _described(runs_dir, names, job):
    found = []
    for name in names:
        if "/" in name or name.startswith("."):  # the share's own: .workdirs, .dtrain-setup
            continue
        entry = describe(runs_dir, name)
        if entry is not None and (job is None or entry["job_id"] == job):
            found.append(entry)
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir")
    parser.add_argument("--job", help="only the run of this Slurm job id")
    parser.add_argument("--run", help="only this run id")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--also", action="append", default=[], help="this run too, however old (repeatable)")
    args = parser.parse_args(argv)
    json.dump(list_runs(args.runs_dir, args.job, args.run, args.limit, args.also), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
