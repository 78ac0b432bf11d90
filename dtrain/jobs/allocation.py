"""What a job asks Slurm for: nodes, GPUs per node (gres), whole nodes or a share of them, and a time
limit, checked against the cluster before anything is submitted, with what that costs per hour.

GPUs are allocated one by one through gres: a job that asks for fewer GPUs than a node has shares the
node with other jobs and sees only its own devices (cgroup ConstrainDevices where the node's Slurm can
constrain devices, CUDA_VISIBLE_DEVICES and docker's --gpus otherwise, docs/operator.md). A job holds
whole nodes when it asks for every GPU of a node, or for --exclusive, and always on CPU nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm_time import check_time_limit, time_limit_seconds
from dtrain.errors import OperatorError
from infra.slurm_time import exceeds, is_unlimited

# A job's hold on whole nodes: every core and GPU (--exclusive), and all of each node's memory, which
# --exclusive alone does not give where memory is consumable (a job without --mem would get the
# partition's DefMemPerGPU for each GPU, or DefMemPerCPU on CPU nodes: infra/cloud_init/slurm.py).
WHOLE_NODE_FLAGS = ("--exclusive", "--mem=0")


@dataclass(frozen=True)
class Allocation:
    nodes: int
    gpus_per_node: int  # gres per node; 0 on CPU nodes
    processes_per_node: int
    exclusive: bool
    time_limit: str

    def describe(self, desc: ClusterDescription) -> str:
        gpus = f"{self.gpus_per_node} of {desc.gpus_per_node} GPUs" if desc.gpus_per_node else "no GPUs (CPU nodes)"
        share = "whole nodes" if self.exclusive else "shared nodes, its own GPUs only"
        node_word = "node" if self.nodes == 1 else "nodes"
        cap = "" if is_unlimited(desc.max_time_limit) else f" (at most {desc.max_time_limit} on this cluster)"
        return (
            f"{self.nodes} {node_word} x {gpus} ({share}), {self.processes_per_node} processes per node, "
            f"time limit {self.time_limit}{cap}"
        )

    def node_share(self, desc: ClusterDescription) -> float:
        """The part of its nodes the job holds: what its hour costs is that share of the node price."""
        if self.exclusive or not desc.gpus_per_node:
            return float(self.nodes)
        return self.nodes * self.gpus_per_node / desc.gpus_per_node


def plan_allocation(
    desc: ClusterDescription,
    *,
    nodes: int | None,
    gpus: int | None,
    gpus_per_node: int | None,
    exclusive: bool,
    time_limit: str | None,
) -> Allocation:
    """The request, or an error naming what is wrong with it (before any connection)."""
    count = nodes or 1
    if count > desc.node_count:
        raise OperatorError(f"--nodes {count}: the cluster has {desc.node_count} nodes")
    per_node = gpus_per_node
    if gpus is not None:
        if gpus_per_node is not None:
            raise OperatorError("--gpus and --gpus-per-node both say how many GPUs: give one of them")
        if gpus % count:
            raise OperatorError(f"--gpus {gpus} does not divide evenly over --nodes {count}")
        per_node = gpus // count
        flag = f"--gpus {gpus}" + (f" over {count} nodes" if count > 1 else "")
    else:
        flag = f"--gpus-per-node {per_node}"
    if per_node is not None and desc.gpus_per_node and per_node > desc.gpus_per_node:
        more = -(-per_node * count // desc.gpus_per_node)
        advice = (
            f"ask for --nodes {more} --gpus-per-node {desc.gpus_per_node}"
            if more <= desc.node_count
            else f"it has {desc.node_count} node{'s' if desc.node_count > 1 else ''}, "
            f"{desc.node_count * desc.gpus_per_node} GPUs in all"
        )
        raise OperatorError(
            f"{flag} asks for {per_node} GPUs on a node, and a node of cluster {desc.name} has "
            f"{desc.gpus_per_node}: {advice}"
        )
    if gpus is not None and not desc.gpus_per_node:
        raise OperatorError(f"--gpus {gpus}: the nodes of cluster {desc.name} have no GPUs (use --gpus-per-node)")
    processes = per_node or desc.gpus_per_node or 1
    if desc.node_cpus and processes > desc.node_cpus:  # as submission's check says it (dtrain/jobs/preflight.py)
        raise OperatorError(
            f"{flag if per_node is not None else 'the default'} runs {processes} processes on each node, "
            f"and the nodes of cluster {desc.name} have "
            f"{desc.node_cpus} CPUs (one a process at least): ask for fewer processes per node"
        )
    gres = processes if desc.gpus_per_node else 0
    # every GPU of a node is the whole node; so is any job on CPU nodes, which have no GPUs to share out
    whole = exclusive or gres == desc.gpus_per_node
    return Allocation(count, gres, processes, whole, _time_limit(desc, time_limit))


def _time_limit(desc: ClusterDescription, asked: str | None) -> str:
    """--time, or the cluster's default; one above the partition's MaxTime would wait in the queue forever."""
    if not asked:
        return desc.default_time_limit
    limit = check_time_limit(asked)
    if exceeds(limit, desc.max_time_limit):
        raise OperatorError(
            f"--time {limit} is longer than cluster {desc.name} allows, {desc.max_time_limit} (maxJobTime in its "
            "stack's config, the partitions' MaxTime): ask for less"
        )
    return limit


def cost_line(alloc: Allocation, desc: ClusterDescription, price_per_node_hour: float | None, source: str) -> str:
    """One line for the operator before submission: the job's estimated hourly cost, and its most."""
    if price_per_node_hour is None:
        return f"estimated cost: unknown ({source})"
    hourly = price_per_node_hour * alloc.node_share(desc)
    most = hourly * time_limit_seconds(alloc.time_limit) / 3600
    return f"estimated cost: ${hourly:,.2f}/hour, at most ${most:,.2f} within the time limit ({source})"


def salloc_flags(alloc: Allocation, partition: str) -> list[str]:
    """The same request as sbatch's #SBATCH lines in job.sh (dtrain/jobs/batch_script.py), for salloc."""
    flags = [f"--partition={partition}", f"--nodes={alloc.nodes}", f"--ntasks-per-node={alloc.processes_per_node}"]
    flags += WHOLE_NODE_FLAGS if alloc.exclusive else ()
    flags += [f"--gres=gpu:{alloc.gpus_per_node}"] if alloc.gpus_per_node else []
    return [*flags, f"--time={alloc.time_limit}"]
