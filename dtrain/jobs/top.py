"""What `dtrain top` shows: the running jobs (step, loss, throughput, time left, from each run's log, or for a job
that logs no step line, the step and loss it logged to its MLflow run) and every GPU's utilisation and memory
(Prometheus), gathered in one round trip to the Slurm login host. Runs on the operator's machine."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from datetime import UTC, datetime

from rich.console import Group
from rich.table import Table

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import QueuedJob, Slurm
from dtrain.cluster.ssh import q
from dtrain.cluster.telemetry import GpuReading, TelemetryUnavailable, gpu_queries, gpu_readings, run_sections
from dtrain.jobs.progress import STEP_LINE_GREP, Progress, parse_progress, progress_from_mlflow
from dtrain.jobs.run_ids import runs_dir

LOG_TAIL_BYTES = 65536  # the newest step line is near the end; never read a whole long log
MLFLOW_TIMEOUT_S = 5
RUN_ID_FILE = "mlflow_run_id"  # in the run directory: the MLflow run the batch script opened (mlflow_run.py)


@dataclass(frozen=True)
class Snapshot:
    taken_at: datetime
    jobs: list[tuple[QueuedJob, Progress | None]]
    gpus: list[GpuReading] | None  # None: no telemetry (none on the cluster, or Prometheus did not answer)


def take_snapshot(desc: ClusterDescription, slurm: Slurm) -> Snapshot:
    running = [job for job in slurm.queue() if job.state == "RUNNING"]
    sections = {f"log-{job.job_id}": _last_step_line(desc, job) for job in running}
    if desc.tracking_uri:
        sections.update({f"mlflow-{job.job_id}": _mlflow_run(desc, desc.tracking_uri, job) for job in running})
    if desc.telemetry is not None:
        sections.update(gpu_queries(desc))
    answers = run_sections(slurm, sections)
    try:
        gpus = gpu_readings(answers) if desc.telemetry is not None else None
    except TelemetryUnavailable:
        gpus = None
    jobs = [(job, _progress(answers, job.job_id)) for job in running]
    return Snapshot(datetime.now(UTC), jobs, gpus)


def _progress(answers: dict[str, str], job_id: str) -> Progress | None:
    """The job's step line; else what it logged to MLflow (the user's own code)."""
    return parse_progress(answers.get(f"log-{job_id}", "")) or progress_from_mlflow(answers.get(f"mlflow-{job_id}", ""))


def _mlflow_run(desc: ClusterDescription, uri: str, job: QueuedJob) -> str:
    """Shell for the login host (it reaches the cluster's MLflow): the job's MLflow run, as JSON."""
    kept = posixpath.join(runs_dir(desc), job.name, RUN_ID_FILE)
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/runs/get"
    return (
        f"id=$(cat {q(kept)} 2>/dev/null) && "
        f'curl -sf --max-time {MLFLOW_TIMEOUT_S} --get --data-urlencode "run_id=$id" {q(url)}'
    )


def _last_step_line(desc: ClusterDescription, job: QueuedJob) -> str:
    log = posixpath.join(runs_dir(desc), job.name, "output.log")
    return f"tail -c {LOG_TAIL_BYTES} {q(log)} 2>/dev/null | grep -E {q(STEP_LINE_GREP)} | tail -n 1"


def render(snapshot: Snapshot, elapsed_s: dict[str, int | None]) -> Group:
    """The two tables; elapsed_s: job id -> seconds it has run (squeue's elapsed time)."""
    jobs = Table(title=f"running jobs ({snapshot.taken_at:%H:%M:%S} UTC)")
    for column in ("job", "run", "user", "nodes", "step", "loss", "images/s", "time left"):
        jobs.add_column(column)
    for job, progress in snapshot.jobs:
        if progress is None:
            jobs.add_row(job.job_id, job.name, job.user, job.nodes, "-", "", "", "")
            continue
        eta = progress.eta_s(elapsed_s.get(job.job_id))
        jobs.add_row(
            job.job_id,
            job.name,
            job.user,
            job.nodes,
            str(progress.step) if progress.total_steps is None else f"{progress.step}/{progress.total_steps}",
            "" if progress.loss is None else f"{progress.loss:.4f}",
            "" if progress.images_per_s is None else f"{progress.images_per_s:.1f}",
            "" if eta is None else _duration(eta),
        )
    gpus = Table(title="GPUs")
    for column in ("node", "gpu", "utilisation", "memory used"):
        gpus.add_column(column)
    for reading in snapshot.gpus or []:
        memory = f"{reading.used_mib / 1024:.1f} / {reading.total_mib / 1024:.1f} GiB"
        gpus.add_row(
            reading.node, str(reading.gpu), f"{reading.util_percent:3.0f} % {_bar(reading.util_percent)}", memory
        )
    if snapshot.gpus is None:
        gpus.caption = "no telemetry: the cluster has no Prometheus, or it did not answer"
    return Group(jobs, gpus)


def _bar(percent: float, width: int = 20) -> str:
    filled = round(max(0.0, min(percent, 100.0)) / 100 * width)
    return "█" * filled + "·" * (width - filled)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"
