"""What `launch` asks for, typed and frozen (LaunchRequest), with the few flags of our training job that the
operator acts on (JobFlags), read once from the job's arguments. Runs on the operator's machine.

dtrain/cli/launch.py builds the request from the command line and a task file (the flags win,
dtrain/jobs/task_file.py merges the file's keys); dtrain/jobs/submit.py checks it and turns it into a
JobSpec. Nothing here reads a command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.jobs.cluster_fit import ClusterNeeds
from dtrain.jobs.job_spec import Launcher
from dtrain.jobs.workdir import MAX_WORKDIR_MB


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in args (the last one wins, as with argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def with_flag_value(args: Sequence[str], flag: str, value: str) -> list[str]:
    """args with every value of flag (`--flag V` or `--flag=V`) replaced by value."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
        elif arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
    return out


@dataclass(frozen=True)
class JobFlags:
    """Our training job's flags (after `--`) that decide something on the operator's side; None: not given."""

    backend: str | None = None  # --backend: picks the default launcher, which must match it
    data: str | None = None  # --data: an ImageNet dataset's classes are checked before submission
    data_dir: str | None = None  # --data-dir: checked on the share, and what --local-copy copies

    @classmethod
    def read(cls, job_args: Sequence[str]) -> JobFlags:
        return cls(
            backend=flag_value(job_args, "--backend"),
            data=flag_value(job_args, "--data"),
            data_dir=flag_value(job_args, "--data-dir"),
        )


@dataclass(frozen=True)
class LaunchRequest:
    framework: str  # with workdir: whose image the command runs in (docker runtime)
    job_args: tuple[str, ...] = ()  # with workdir: the whole command, run as written
    job_flags: JobFlags = JobFlags()  # of our job (none with workdir: the command is the user's own)
    nodes: int | None = None  # default: 1
    processes_per_node: int | None = None  # default: GPUs per node (1 on CPU nodes)
    gpus: int | None = None  # the job's GPUs in all (instead of processes_per_node)
    exclusive: bool = False  # whole nodes even when the job asks for fewer GPUs than a node has
    workdir: str | None = None  # the user's own code: sent to the run directory, the command runs there
    workdir_max_mb: float = MAX_WORKDIR_MB
    launcher: Launcher | None = None  # default: torchrun for `--backend ddp` and model parallelism, else horovodrun
    model_parallel: bool = False  # PyTorch FSDP / pipeline / tensor parallel: training.model_parallel under torchrun
    entrypoint: str | None = None  # default: python -m training.<framework>; a .py path or a module
    image: str | None = None  # docker runtime: instead of the framework's image
    run_id: str | None = None
    requeue: bool = False
    gate: bool = True  # measure a multi-node job's nodes before it trains (dtrain/jobs/node_gate.py)
    time_limit: str | None = None  # Slurm's --time syntax; default: the cluster description's
    local_copy: bool = False  # copy --data-dir to every node's local_data_path first, and train from there
    spot: bool = False  # the Spot partition; evictions checkpoint and requeue the job
    spot_fallback: bool = False  # the Spot partition where Slurm can start it there, else on demand
    resume_from: str | None = None  # a run whose newest kept checkpoint (results container) this one starts from
    name: str | None = None  # a task's name: the run id's prefix
    mode: str | None = None  # per-rank (default: the command runs on every rank) or per-node (it is the launcher)
    setup: str | None = None  # a task's setup script: once per node, cached (dtrain/jobs/task_steps.py)
    envs: dict[str, str] = field(default_factory=dict)  # for the user's command (and setup), in job.sh
    secrets: tuple[str, ...] = ()  # names, read from the operator's environment at launch
    tracking_uri: str | None = None  # MLflow server instead of the cluster's ("none": untracked)
    experiment: str | None = None  # MLflow experiment (default: the cluster's name)
    warn_before: int | None = None  # seconds of SIGUSR1 before the time limit; default: time_warning.DEFAULT_S
    needs: ClusterNeeds | None = None  # a task file's SkyPilot resources: what the nodes must have (cluster_fit.py)

    @property
    def requeued(self) -> bool:
        """Whether Slurm may run the job again (a node failure, a Spot eviction): then it keeps checkpoints."""
        return self.requeue or self.spot or self.spot_fallback
