"""What a task file's SkyPilot resources ask of the cluster (dtrain/jobs/skypilot_keys.py reads them), checked
against its description before anything is sent: the GPUs' name and count, the node's vCPUs, memory and OS
disk, its Azure size, cloud, region and network, and the staged datasets that file_mounts name. Runs on the
operator's machine.

SkyPilot picks machines that have what a task asks for; here the nodes exist, so a request is met by them
or refused in one line naming its key. Where the description does not know a fact (the local cluster's
memory and disk, the name of its emulated GPUs), that request is not checked.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from dtrain.cluster.description import ClusterDescription
from dtrain.errors import OperatorError
from infra.contract import GPU_NODE_OS_DISK_GB
from infra.skus import GPU_SKUS, GpuSku

# SkyPilot's names for the GPUs of our sizes (infra/skus.py), where they differ: its A100 is the 40 GB one
SKYPILOT_GPU_NAMES = {"A100 40GB": "A100", "A100 80GB": "A100-80GB"}


@dataclass(frozen=True)
class ClusterNeeds:
    """A task's requests of the nodes, in SkyPilot's terms (each None or empty: not asked)."""

    accelerators: tuple[tuple[str, int], ...] = ()  # (name, count per node) candidates, in order
    cpus: float | None = None  # at least, per node
    memory_gib: float | None = None  # at least, per node
    disk_gib: float | None = None  # the OS disk, at least
    instance_type: str | None = None
    network_tier: str | None = None  # standard, or best (InfiniBand)
    cloud: str | None = None  # azure, or * (checked when read)
    region: str | None = None
    mounts: tuple[tuple[str, str], ...] = ()  # (path on the nodes, source URL)
    task_file: str = ""  # where the requests come from: an error names it


@dataclass(frozen=True)
class Fit:
    gpus_per_node: int | None  # the accelerators' count, or None where the task named none
    datasets: tuple[str, ...]  # the mounted datasets' directories on the shared file system


def fit_to_cluster(desc: ClusterDescription, needs: ClusterNeeds) -> Fit:
    """The task's requests met by the cluster's nodes, or one error naming the file and the first key not met."""
    sku = GPU_SKUS.get(desc.gpu_sku or "")
    try:
        _check_place(desc, needs)
        _check_size(desc, sku, needs)
        gpus = _choose_accelerator(desc, sku, needs.accelerators) if needs.accelerators else None
        return Fit(gpus, tuple(_dataset(desc, path, source) for path, source in needs.mounts))
    except OperatorError as exc:
        raise OperatorError(f"{needs.task_file}: {exc}" if needs.task_file else str(exc)) from None


def _check_place(desc: ClusterDescription, needs: ClusterNeeds) -> None:
    """cloud/infra, region and network_tier: where the nodes are and how they are joined."""
    if needs.cloud == "azure" and desc.provider != "azure":
        raise OperatorError(f"resources.cloud: azure, and cluster {desc.name} is the local emulation of one")
    if needs.region and needs.region.lower() != (desc.region or "").lower():
        where = f"in {desc.region}" if desc.region else "the local emulation, in no Azure region"
        raise OperatorError(f"resources.region: {needs.region}, and cluster {desc.name} is {where}")
    if needs.network_tier == "best" and not desc.expect_infiniband:
        raise OperatorError(
            f"resources.network_tier: best asks for InfiniBand, and the nodes of cluster {desc.name} have none"
        )


def _check_size(desc: ClusterDescription, sku: GpuSku | None, needs: ClusterNeeds) -> None:
    """instance_type, cpus, memory and disk_size against the node's size, where the description knows it."""
    if needs.instance_type and needs.instance_type.lower() != (desc.gpu_sku or "").lower():
        size = f"are {desc.gpu_sku} (the stack's gpuSku)" if desc.gpu_sku else "have no Azure size (local)"
        raise OperatorError(
            f"resources.instance_type: {needs.instance_type}, and the nodes of cluster {desc.name} {size}"
        )
    cpus = desc.node_cpus or (sku.vcpus if sku else None)
    if needs.cpus is not None and cpus is not None and needs.cpus > cpus:
        raise OperatorError(f"resources.cpus: {needs.cpus:g}, and a node of cluster {desc.name} has {cpus} vCPUs")
    if needs.memory_gib is not None and sku is not None and needs.memory_gib > sku.memory_gib:
        raise OperatorError(
            f"resources.memory: {needs.memory_gib:g} GB, and a node of cluster {desc.name} has {sku.memory_gib} GB"
        )
    if needs.disk_gib is not None and desc.provider == "azure" and needs.disk_gib > GPU_NODE_OS_DISK_GB:
        nvme = f" (its local NVMe, {desc.local_data_path})" if desc.local_data_path else ""
        raise OperatorError(
            f"resources.disk_size: {needs.disk_gib:g} GB, and a node's OS disk is {GPU_NODE_OS_DISK_GB} GB: large "
            f"files belong on the shared file system (`dtrain stage`, $OUTPUT_DIR) or the node's own disk{nvme}"
        )


def _choose_accelerator(desc: ClusterDescription, sku: GpuSku | None, candidates: tuple[tuple[str, int], ...]) -> int:
    """The count of the first candidate the nodes have (SkyPilot tries a list in order, a set in any): the
    name matches the nodes' GPUs (any name where the description names none: the local emulated GPUs),
    and the count fits on a node."""
    asked = ", ".join(f"{name}:{count}" for name, count in candidates)
    if not desc.gpus_per_node:
        raise OperatorError(f"resources.accelerators: {asked}, and the nodes of cluster {desc.name} have no GPUs")
    have = SKYPILOT_GPU_NAMES.get(sku.gpu, sku.gpu) if sku else None
    named = [count for name, count in candidates if have is None or name.lower() == have.lower()]
    if not named:
        raise OperatorError(
            f"resources.accelerators: {asked}, and the nodes of cluster {desc.name} have {desc.gpus_per_node} {have} "
            f"({desc.gpu_sku})"
        )
    fits = [count for count in named if count <= desc.gpus_per_node]
    if not fits:
        raise OperatorError(
            f"resources.accelerators: {asked} asks for {named[0]} GPUs on a node, and a node of cluster {desc.name} "
            f"has {desc.gpus_per_node}: ask for at most {desc.gpus_per_node}, on more num_nodes"
        )
    return fits[0]


def _dataset(desc: ClusterDescription, path: str, source: str) -> str:
    """A file mount of a staged dataset: its source is the dataset in the data container, its path the one the
    nodes see it at (<data_path>/<dataset>, where `dtrain stage` pulls it)."""
    container = desc.data.url.rstrip("/") + "/"
    if not source.startswith(container) or not source[len(container) :].strip("/"):
        raise OperatorError(
            f"file_mounts: {path}: {source} is not a dataset in cluster {desc.name}'s data container ({container}"
            "NAME): stage it there with `dtrain stage all DIR --dataset NAME`"
        )
    dataset = posixpath.normpath(posixpath.join(desc.data_path, source[len(container) :].strip("/")))
    if not dataset.startswith(posixpath.normpath(desc.data_path) + "/"):
        raise OperatorError(f"file_mounts: {path}: {source} is outside the data container's datasets")
    if posixpath.normpath(path) != dataset:
        raise OperatorError(
            f"file_mounts: {path}: the nodes see {source} at {dataset} (`dtrain stage` pulls it there): mount it there"
        )
    return dataset
