"""The runs on the cluster's shared file system, read through the login node (dtrain/remote/login/list_runs.py),
and the one way every command turns `JOB` (a Slurm job id or a run id) into a run."""

from __future__ import annotations

import json
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import JOB_ID, EndedJob, Slurm
from dtrain.cluster.ssh import q
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.run_ids import RUN_ID, check_run_id, runs_dir

LIST_RUNS = Path(__file__).resolve().parents[1] / "remote" / "login" / "list_runs.py"


@dataclass(frozen=True)
class Run:
    run_id: str | None  # None: a job that was not submitted by `launch` (no run directory)
    job_id: str | None
    run_dir: str | None = None
    job: dict[str, Any] | None = None  # job.json
    status: dict[str, Any] | None = None  # status.json: the exit, once the job has ended
    verdict: dict[str, Any] | None = None  # verdict.json: which rank failed, and why
    record: dict[str, Any] | None = None  # run.json: attempts, node-hours, billed node-hours, estimated cost
    owner: str | None = None  # the user whose run it is (its directory's owner; Slurm's user of a job without one)
    readable: bool = True  # False: another user's run, whose directory (0700) the file system keeps from us
    slow_ranks: dict[str, Any] | None = None  # slow_ranks.json of the attempt now running (dtrain/jobs/slow_ranks.py)

    @property
    def cost_summary(self) -> str | None:
        """'0.0123 node-hours, billed 0.0015 (its GPUs), estimated $1.23' once the job has ended (no price:
        node-hours alone)."""
        if not self.record or self.record.get("node_hours") is None:
            return None
        hours, billed = self.record["node_hours"], self.record.get("billed_node_hours")
        cost = self.record.get("estimated_cost_usd")
        share = "" if billed is None or billed == hours else f", billed {billed:.4f} (the GPUs it held)"
        return f"{hours:.4f} node-hours{share}" + ("" if cost is None else f", estimated ${cost:.2f}")

    @property
    def label(self) -> str:
        return f"job {self.job_id or '?'} (run {self.run_id})" if self.run_id else f"job {self.job_id}"

    def check_readable(self) -> Run:
        """self, where its run directory is the caller's to read; else the one-line refusal."""
        if not self.readable:
            raise OperatorError(
                f"{self.label} is {self.owner}'s: its run directory is theirs alone (0700), and the file system "
                "refuses you its logs, checkpoints and secrets",
                ExitCode.NOT_READY,
            )
        return self

    @property
    def exit_code(self) -> int | None:
        return None if self.status is None else int(self.status.get("exit_code", 1))

    @property
    def ended_by_time_limit(self) -> bool:
        """Whether Slurm ended the last attempt at its time limit (job.sh's TERM trap tells it from a cancel)."""
        return (self.status or {}).get("ended_by") == "time_limit"

    @property
    def cancelled(self) -> bool:
        """Whether the last attempt was cancelled: ended by SIGTERM or SIGINT (scancel, Ctrl-C), not by its limit."""
        return self.exit_code in (130, 143) and not self.ended_by_time_limit


def without_status(ended: EndedJob | None) -> tuple[str, str]:
    """(state, why) of a run whose job ended without writing its status (its batch script never ran, or
    was killed), from Slurm's record of the job; a plainer guess once Slurm has forgotten it."""
    if ended is None:
        return "ENDED", "no exit status, and Slurm has forgotten the job: cancelled while pending, or its node failed"
    if ended.state == "CANCELLED" and not ended.started:
        return "CANCELLED", "cancelled while pending"
    what = [ended.state if ended.reason in ("", "None") else f"{ended.state} ({ended.reason})"]
    if ended.signal:
        what.append(f"batch script killed by signal {ended.signal} ({_signal_name(ended.signal)})")
    elif ended.exit_status:
        what.append(f"batch script exit {ended.exit_status}")
    when = "before it wrote its exit status" if ended.started else "before it started"
    return ended.state, f"Slurm says {', '.join(what)} {when}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "?"


def list_runs(
    desc: ClusterDescription,
    slurm: Slurm,
    *,
    job: str | None = None,
    run: str | None = None,
    limit: int = 20,
    also: Sequence[str] = (),
) -> list[Run]:
    """The newest runs first (at most limit), or just the run of a job id or a run id; also: these runs too
    (the running jobs': their directories may be older than the newest runs). One call to the login node."""
    args = [runs_dir(desc), "--limit", str(limit)]
    args += ["--job", job] if job else []
    args += ["--run", run] if run else []
    for name in also:
        args += ["--also", name]
    command = f"{q(desc.remote_python)} - {' '.join(q(a) for a in args)}"
    result = slurm.run_unchecked(command, input=LIST_RUNS.read_bytes())
    try:
        entries = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise OperatorError(
            f"reading the runs on the login node failed: {(result.stderr or result.stdout).strip()[-400:]}",
            ExitCode.FAILED,
        ) from None
    fields = ("run_id", "job_id", "run_dir", "job", "status", "verdict")
    return [
        Run(
            *(e[f] for f in fields),
            e.get("record"),
            owner=e.get("owner"),
            readable=e.get("readable", True),
            slow_ranks=e.get("slow_ranks"),
        )
        for e in entries
    ]


def check_job_reference(text: str) -> str:
    """JOB on the command line: a Slurm job id, or a valid run id (checked before any connection)."""
    return text if JOB_ID.fullmatch(text) else check_run_id(text)


def resolve(desc: ClusterDescription, slurm: Slurm, text: str) -> Run:
    """JOB as the user typed it: digits are a Slurm job id, anything else a run id. Another user's run comes
    back unreadable, with its owner and, while Slurm holds it, its job id (Slurm names the job after its run)."""
    if JOB_ID.fullmatch(text):
        found = list_runs(desc, slurm, job=text, limit=1)
        if found:
            return found[0]
        queued = slurm.queue(text)
        if not queued:
            raise OperatorError(f"no job {text}: not in Slurm's queue, and no run of it (see `dtrain jobs`)")
        job = queued[0]
        # another user's: its directory hides its job id from us, Slurm does not
        theirs = list_runs(desc, slurm, run=job.name, limit=1) if RUN_ID.fullmatch(job.name) else []
        if theirs and not theirs[0].readable:
            return replace(theirs[0], job_id=text)
        return Run(run_id=None, job_id=text, owner=job.user)
    found = list_runs(desc, slurm, run=check_run_id(text), limit=1)
    if not found:
        raise OperatorError(f"no run {text} in {runs_dir(desc)} (see `dtrain jobs`)")
    if found[0].readable:
        return found[0]
    queued = [job for job in slurm.queue() if job.name == text]
    return replace(found[0], job_id=queued[0].job_id if queued else None)
