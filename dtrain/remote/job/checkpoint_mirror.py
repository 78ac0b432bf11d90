#!/usr/bin/env python3
"""checkpoint-mirror: copy a job's $CHECKPOINT_DIR to the results container while the job runs.

Standard library only, Python 3.10+: job.sh starts it in the background on the first node, beside the
launcher, from the run's `remote/` directory (with upload_results.py, whose blob client it uses), and
stops it when the job ends, when upload_results.py --with-checkpoints makes the last pass (as --once
does here, by hand). Any code's checkpoints so reach storage that outlives the cluster
(`launch --resume-from RUN` starts a new run from them), not only our jobs' file names.

  python3 checkpoint_mirror.py --dir RUN_DIR/checkpoints --prefix RUN_ID/checkpoints --state FILE \\
      --account-url URL --container results (--sas-file FILE | --managed-identity [--client-id ID])

Every INTERVAL seconds it lists the directory (the shared file system, where every node's ranks write)
and uploads each regular file that is new or changed since its last upload and complete: its size and
modification time are the same as at the scan before (closed and stable), whole files only, to the
block blob PREFIX/<relative path>. Names starting with `.` (a file or a directory on the way) are
temporary by convention, ours included (write to `.name.tmp`, then rename into place), and never
copied. What was uploaded is remembered in --state FILE, so that the last pass (the job's end: every
file, stable or not, as the job has stopped writing) and a requeued attempt send only what is new.
Files deleted from DIR stay in the container (a run's older checkpoints, for a resume from before).

Why our own, and not azcopy sync or inotify: azcopy is on the HPC image (Azure/azhpc-images
components/install_azcopy.sh) but not on the local cluster, and `azcopy sync` copies whatever a
directory holds when it runs, a checkpoint still being written included (it has no notion of a file
being complete); inotify sees only this node's writes to a shared file system, not other nodes'. This
needs the node's bare python3 and the blob client the job's results upload already uses.

Exit status (--once): 0 all uploaded; 1 some files failed (each is named on stderr, with why: access
refused, storage unreachable); 2 bad arguments. Without --once it runs until SIGTERM, which ends it
after the upload in progress; a file that failed is tried again at the next scan.
"""

import argparse
import json
import os
import signal
import sys
import time

from upload_results import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    UploadError,
    add_container_arguments,
    blob_prefix,
    check_container_arguments,
    open_container,
    upload_file,
)

# relative path -> [size, mtime_ns] of its last upload; in the run's remote/ directory (job.sh's --state), not
# in the job's own checkpoint directory, which its code may list
STATE = "checkpoints-mirrored.json"
INTERVAL_S = 10.0
TOKEN_TTL_S = 1800  # an IMDS token lasts hours; take a new one well before
LABEL = "[job] checkpoint mirror: "  # its lines in output.log (job.sh does not pipe it through sed)


def scan(directory):
    """{relative POSIX path: (size, mtime_ns)} of the regular files under directory, but temporary ones."""
    found = {}
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            path = os.path.join(root, name)
            if name.startswith(".") or os.path.islink(path):
                continue
            try:
                info = os.stat(path)
            except OSError:
                continue  # renamed or deleted meanwhile
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            found[relative] = (info.st_size, info.st_mtime_ns)
    return found


def load_state(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return {name: tuple(seen) for name, seen in json.load(handle).items()}
    except (OSError, ValueError, TypeError):
        return {}


def save_state(path, state):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
        json.dump(state, handle)
    os.replace(f"{path}.tmp", path)


class Mirror:
    """What was uploaded and what the last scan saw; one pass uploads what is due."""

    def __init__(self, directory, prefix, connect, state, label=LABEL):
        self.directory, self.prefix, self.connect, self.label = directory, prefix, connect, label
        self.state = state
        self.uploaded = load_state(state)
        self.seen = {}
        self.container, self.connected_at = None, 0.0

    def due(self, now, every):
        """The files to upload: changed since their upload, and (unless every) as they were at the last scan."""
        changed = {name: seen for name, seen in now.items() if self.uploaded.get(name) != seen}
        return {name: seen for name, seen in changed.items() if every or self.seen.get(name) == seen}

    def run_pass(self, every=False, stopping=()):
        """Scan, upload what is due (until stopping is true); returns {relative path: why} for the files
        that failed."""
        now = scan(self.directory) if os.path.isdir(self.directory) else {}
        failures = {}
        for name, seen in sorted(self.due(now, every).items()):
            if stopping:
                break
            try:
                size = upload_file(self._container(), os.path.join(self.directory, name), f"{self.prefix}/{name}")
            except UploadError as exc:
                failures[name] = str(exc)
                self.container = None  # a new credential next time (an expired token)
                continue
            except OSError as exc:  # deleted meanwhile
                failures[name] = f"cannot read it: {exc.strerror or exc}"
                continue
            self.uploaded[name] = seen
            save_state(self.state, self.uploaded)
            print(f"{self.label}{name} ({size / 1e6:.1f} MB) is in the results container", flush=True)
        self.seen = now
        return failures

    def _container(self):
        if self.container is None or time.monotonic() - self.connected_at > TOKEN_TTL_S:
            self.container, self.connected_at = self.connect(), time.monotonic()
        return self.container


def build_parser():
    parser = argparse.ArgumentParser(
        prog="checkpoint_mirror.py",
        description="Upload the complete files of a checkpoint directory to a blob container as they appear.",
    )
    parser.add_argument("--dir", required=True, help="the job's checkpoint directory ($CHECKPOINT_DIR)")
    parser.add_argument("--prefix", required=True, type=blob_prefix, help="blob names start with PREFIX/")
    parser.add_argument("--state", required=True, help=f"where it remembers what it sent (job.sh: remote/{STATE})")
    add_container_arguments(parser)
    parser.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between scans (default 10)")
    parser.add_argument("--once", action="store_true", help="one pass that uploads every new file, then exit")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_container_arguments(parser, args)
    if args.interval <= 0:
        parser.error("--interval must be above 0")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    mirror = Mirror(args.dir, args.prefix, lambda: open_container(args), args.state)
    try:
        if args.once:
            failures = mirror.run_pass(every=True)
            for name, why in sorted(failures.items()):
                print(f"checkpoint_mirror: error: {name} not uploaded: {why}", file=sys.stderr)
            return EXIT_FAILED if failures else 0
        while not stopping:
            for name, why in mirror.run_pass(stopping=stopping).items():
                print(f"{LABEL}{name} not uploaded yet: {why}", flush=True)
            deadline = time.monotonic() + args.interval
            while not stopping and time.monotonic() < deadline:
                time.sleep(min(0.2, args.interval))  # job.sh's finish() waits for it to stop
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
