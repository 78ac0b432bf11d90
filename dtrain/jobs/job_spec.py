"""What a run's batch script is made from (JobSpec and its parts), and the named sections of job.sh that
each of the script's features fills (ScriptLines). Data only; runs on the operator's machine.

dtrain/jobs/submit.py builds a JobSpec from a launch request and the cluster description; the script's
features (checkpoint_sync.py, task_steps.py, tracking.py, node_gate.py) read its parts and return their
lines as ScriptLines, which dtrain/jobs/batch_script.py puts in their sections. No feature imports the
script: it calls them, never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from infra.health_thresholds import GateThresholds

Launcher = Literal["horovodrun", "torchrun"]


@dataclass(frozen=True)
class ResultsTarget:
    """Where the job uploads its run directory, and with what (a SAS file in the run, or an identity)."""

    account_url: str
    container: str
    sas_file: str | None = None  # a file in the run directory (0600), never on a command line
    client_id: str | None = None  # the cluster's user-assigned identity (Azure)


@dataclass(frozen=True)
class LocalCopy:
    """launch --local-copy: every node copies the dataset from the share to its own disk before training."""

    source: str  # the job's --data-dir, on the shared file system
    dest: str  # the same path on every node, under the cluster's local_data_path


@dataclass(frozen=True)
class Tracking:
    """The run's MLflow server (dtrain/jobs/tracking.py plans it)."""

    uri: str  # http(s)://host:port of an MLflow tracking server, as the nodes reach it
    experiment: str  # the cluster's name unless --experiment says otherwise
    tags: Mapping[str, str] = field(default_factory=dict)  # the run's, besides its run id and Slurm job id
    prometheus_url: str | None = None  # the cluster's, as the nodes reach it: the run's system metrics


@dataclass(frozen=True)
class JobSpec:
    run_id: str
    run_dir: str  # on the shared file system, the same path on every node
    launcher: Launcher
    nodes: int
    processes_per_node: int
    gpus_per_node: int  # GRES to ask for per node (0: CPU nodes)
    partition: str
    command: Sequence[str]  # the training program and its flags
    workdir: str  # where the `training` package is (on the node, or in the image)
    python: str  # the training environment's python (its directory holds horovodrun/torchrun)
    remote_python: str  # a stdlib python3 on the nodes, for the remote tools
    results: ResultsTarget
    image: str | None = None  # docker runtime; None: the host environment
    shared_mount: str = "/shared"
    network_interface: str | None = None
    infiniband: bool = False
    requeue: bool = False
    time_limit: str | None = None  # Slurm's --time syntax (minutes, HH:MM:SS, D-HH:MM, ...)
    exclusive: bool = False  # whole nodes; otherwise the job shares its nodes, holding only its GPUs (gres)
    git_revision: str | None = None  # of the operator's checkout: recorded in the model export
    env: dict[str, str] = field(default_factory=dict)  # NCCL settings and the like, for every rank
    local_copy: LocalCopy | None = None
    mode: Literal["per-rank", "per-node"] = "per-rank"  # per-node: the command is the user's own launcher
    setup_cache_dir: str | None = None  # a task's setup runs once per node, its markers kept here (task_steps.py)
    secrets: tuple[str, ...] = ()  # the names of the secrets in <run>/secrets/env (their values are never here)
    tracking: Tracking | None = None  # the MLflow server of the run (dtrain/jobs/tracking.py)
    resume_from: str | None = None  # a run whose kept checkpoint the job fetches first (dtrain/jobs/checkpoint_sync.py)
    warn_before_s: int = 0  # SIGUSR1 this long before the time limit (dtrain/jobs/time_warning.py); 0: none
    cluster_info: str = ""  # SKYPILOT_CLUSTER_INFO's JSON for setup and per-node mode (task_steps.py)
    gate: GateThresholds | None = None  # the nodes measured before a multi-node job (node_gate.py); None: not
    gate_image: str | None = None  # docker runtime: the image the gate runs in (PyTorch's); None: the job's

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def gated(self) -> bool:
        """Whether the job measures its nodes first, and may requeue itself without a slow one."""
        return self.gate is not None and self.nodes > 1


@dataclass(frozen=True)
class ScriptLines:
    """One feature's lines for the named sections of job.sh; batch_script.py orders the features within
    each section (a run's MLflow close needs the secrets that the task's part removes after it)."""

    prologue: Sequence[str] = ()  # once the EXIT trap is set, before the TERM trap: what finish() undoes
    before_launch: Sequence[str] = ()  # after the prologue, before the launcher starts: steps, fetches, setup
    on_finish: Sequence[str] = ()  # in finish(), once the attempt is recorded, before the results upload
    runs_steps: bool = False  # before_launch calls run_step (batch_script.RUN_STEP), which job.sh then defines
