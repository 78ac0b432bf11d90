"""The runs on the cluster's shared file system, read through the login node (dtrain/remote/login/list_runs.py),
and the one way every command turns `JOB` (a Slurm job id or a run id) into a run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import JOB_ID, Slurm
from dtrain.cluster.ssh import q
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.submit import REMOTE_DIR, check_run_id, runs_dir

LIST_RUNS = REMOTE_DIR / "login" / "list_runs.py"


@dataclass(frozen=True)
class Run:
    run_id: str | None  # None: a job that was not submitted by `launch` (no run directory)
    job_id: str | None
    run_dir: str | None = None
    job: dict[str, Any] | None = None  # job.json
    status: dict[str, Any] | None = None  # status.json: the exit, once the job has ended
    verdict: dict[str, Any] | None = None  # verdict.json: which rank failed, and why
    record: dict[str, Any] | None = None  # run.json: attempts, node-hours, billed node-hours, estimated cost

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


def list_runs(
    desc: ClusterDescription, slurm: Slurm, *, job: str | None = None, run: str | None = None, limit: int = 20
) -> list[Run]:
    """The newest runs first (at most limit), or just the run of a job id or a run id."""
    args = [runs_dir(desc), "--limit", str(limit)]
    args += ["--job", job] if job else []
    args += ["--run", run] if run else []
    command = f"{q(desc.remote_python)} - {' '.join(q(a) for a in args)}"
    result = slurm.run_unchecked(command, input=LIST_RUNS.read_bytes())
    try:
        entries = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise OperatorError(
            f"reading the runs on the login node failed: {(result.stderr or result.stdout).strip()[-400:]}",
            ExitCode.FAILED,
        ) from None
    return [
        Run(e["run_id"], e["job_id"], e["run_dir"], e["job"], e["status"], e["verdict"], e.get("record"))
        for e in entries
    ]


def check_job_reference(text: str) -> str:
    """JOB on the command line: a Slurm job id, or a valid run id (checked before any connection)."""
    return text if JOB_ID.fullmatch(text) else check_run_id(text)


def resolve(desc: ClusterDescription, slurm: Slurm, text: str) -> Run:
    """JOB as the user typed it: digits are a Slurm job id, anything else a run id."""
    if JOB_ID.fullmatch(text):
        found = list_runs(desc, slurm, job=text, limit=1)
        if found:
            return found[0]
        if slurm.queue(text):
            return Run(run_id=None, job_id=text)
        raise OperatorError(f"no job {text}: not in Slurm's queue, and no run of it (see `dtrain jobs`)")
    found = list_runs(desc, slurm, run=check_run_id(text), limit=1)
    if not found:
        raise OperatorError(f"no run {text} in {runs_dir(desc)} (see `dtrain jobs`)")
    return found[0]
