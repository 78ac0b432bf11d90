"""What `launch` checks about the job's inputs before anything is submitted.

Two kinds of check. Before any connection: the job's `--data-dir` must be a dataset under the
cluster's data path (the only place `stage` puts data, and the only one every node sees). On the
login node, in the same SSH round trip that submits (it sees the shared file system as the nodes
do): the dataset exists, an ImageNet one has at least two class folders, and a `.py` entrypoint on
a file system the login node shares with the nodes exists. Each failed check is one exit status of
that round trip (`Preflight.codes`), turned into one `error:` line with exit 2, before the run
directory is made; a job that would fail at its first step is never queued.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.ssh import q
from dtrain.errors import OperatorError
from dtrain.jobs.launch_request import JobFlags

# The round trip's own exit statuses (sbatch and the shell use 0-2 and 126-127).
NO_DATA, ONE_CLASS, NO_ENTRYPOINT, TOO_FEW_CPUS, NO_MOUNTED_DATA = 18, 19, 20, 21, 22
STAGE_HINT = "dtrain stage all DIR --dataset NAME"


def dataset_under_data_path(desc: ClusterDescription, data_dir: str, what: str = "--data-dir") -> str:
    """data_dir's path relative to the cluster's data path; refused when it is not a dataset there."""
    shared = posixpath.normpath(desc.data_path)
    relative = posixpath.relpath(posixpath.normpath(data_dir), shared) if posixpath.isabs(data_dir) else ".."
    if relative == "." or relative.startswith(".."):
        raise OperatorError(
            f"{what} {data_dir} is not a dataset under the cluster's data path {shared}, the one the nodes "
            f"see: stage it there ({STAGE_HINT}) and pass {shared}/NAME"
        )
    return relative


@dataclass
class Preflight:
    """Shell for the login node (each check exits with its own status) and the message of each status."""

    script: str = ""
    codes: dict[int, str] = field(default_factory=dict)

    def add(self, condition: str, code: int, message: str) -> None:
        """Fail with code unless condition (a shell test) holds."""
        self.script += f"{condition} || exit {code}; "
        self.codes[code] = message

    def refusal(self, returncode: int) -> OperatorError | None:
        message = self.codes.get(returncode)
        return OperatorError(message) if message is not None else None


@dataclass(frozen=True)
class ProcessRequest:
    """How many processes the job runs on each node, in which partitions, and the flag that asked."""

    per_node: int
    partitions: str  # sbatch's --partition: one, or several separated by commas
    flag: str  # as the user gave it: "--gpus-per-node 3", "--gpus 4 over 2 nodes", or "the default of 1"


def plan_preflight(
    desc: ClusterDescription,
    job: JobFlags,
    *,
    entrypoint: str | None,
    model_parallel: bool,
    processes: ProcessRequest | None = None,
    datasets: Sequence[str] = (),
) -> Preflight:
    """Refuse what can be refused here; return the checks the login node makes. job: our job's flags (none
    for the user's own command)."""
    checks = Preflight()
    if processes is not None:
        # One CPU per process at least: Slurm would refuse more tasks than a node's CPUs at sbatch, in
        # its own words and with exit 1. The description does not know the nodes' CPUs; Slurm does.
        cpus = f"$(sinfo -h -p {q(processes.partitions)} -o %c | tr -d + | sort -n | head -1)"
        checks.add(
            f'{{ c={cpus}; [ -z "$c" ] || [ "$c" -ge {processes.per_node} ]; }}',
            TOO_FEW_CPUS,
            f"{processes.flag} runs {processes.per_node} processes on each node, and the nodes of cluster "
            f"{desc.name} have fewer CPUs than that (`dtrain status` lists them): ask for fewer processes per node",
        )
    data_dir = job.data_dir
    if data_dir is not None:
        dataset_under_data_path(desc, data_dir)
        checks.add(
            f"[ -d {q(data_dir)} ]",
            NO_DATA,
            f"--data-dir {data_dir} is not on the shared file system: stage the dataset first ({STAGE_HINT})",
        )
        if job.data == "imagenet" and not model_parallel and entrypoint is None:
            train = posixpath.join(data_dir, "train")
            # a one-class "classifier" trains and exports, and is useless: the job refuses it too
            checks.add(
                f'{{ [ ! -d {q(train)} ] || {{ set -- {q(train)}/*/; [ "$#" -ge 2 ] || [ ! -d "$1" ]; }}; }}',
                ONE_CLASS,
                f"--data-dir {data_dir} has one class folder under train/: a classifier needs at least two",
            )
    if datasets:  # a task file's file_mounts (dtrain/jobs/cluster_fit.py): each on the share already
        checks.add(
            " && ".join(f"[ -d {q(path)} ]" for path in datasets),
            NO_MOUNTED_DATA,
            f"file_mounts: {', '.join(datasets)}: not all on the shared file system: stage each dataset first "
            f"({STAGE_HINT})",
        )
    script = entrypoint_seen_by_login_node(desc, entrypoint)
    if script is not None:
        checks.add(
            f"[ -f {q(script)} ]",
            NO_ENTRYPOINT,
            f"--entrypoint {entrypoint}: {script} does not exist on the cluster's file system",
        )
    return checks


def entrypoint_seen_by_login_node(desc: ClusterDescription, entrypoint: str | None) -> str | None:
    """The path of a `.py` entrypoint, where the login node sees what the nodes see: on the shared
    file system, or anywhere with the host runtime on a local cluster (its nodes share this machine's
    files). None where it cannot be checked before the job runs: a module name, or a file in the image."""
    if entrypoint is None or not entrypoint.endswith(".py"):
        return None
    path = posixpath.normpath(posixpath.join(desc.runtime.workdir, entrypoint))
    shared = posixpath.normpath(desc.shared_mount_path)
    if path == shared or path.startswith(shared + "/"):
        return path
    if desc.runtime.kind == "host" and desc.provider == "local":
        return path
    return None
