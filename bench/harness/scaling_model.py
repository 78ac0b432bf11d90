"""Analytical model of data-parallel scaling efficiency (pure: no framework imports).

One synchronous step on ``n`` workers costs the single-worker compute time ``t1`` plus the
part of the gradient allreduce that the backward pass does not hide:

    t_ring    = 2 (n - 1) / n * bytes / bus_bw            (ring allreduce, NCCL's busBW definition)
    t_latency = buckets * 2 * ceil(log2 n) * alpha        (per fused allreduce, tree-like hops)
    exposed   = max(0, t_ring - overlap * t1) + t_latency
    E(n)      = t1 / (t1 + exposed)

``overlap`` is the fraction of the step during which gradients are already flowing: Horovod
and DDP launch a fused bucket as soon as its gradients exist, so communication can hide
behind the rest of the backward pass (about two thirds of a ResNet step) minus the time to
fill the first bucket. We take 0.5 as the default and show the 0 (no overlap) bound beside it.
``bus_bw`` is NCCL's bus bandwidth for the span of the job: NVLink within one node, the
InfiniBand fabric (all rails of the node) beyond it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RESNET50_PARAMS = 25_557_032  # torchvision resnet50; the "25.6 M"
GB = 1e9
DEFAULT_OVERLAP = 0.5
DEFAULT_ALPHA_S = 10e-6  # one IB/NVLink hop including NCCL's kernel launch, order of magnitude
DEFAULT_FUSION_BYTES = 64 * 2**20  # Horovod's HOROVOD_FUSION_THRESHOLD default


@dataclass(frozen=True)
class Cluster:
    """Where the job runs: GPUs per node and the allreduce bus bandwidth in and across nodes."""

    name: str
    gpus_per_node: int
    intra_bus_gbps: float  # GB/s, NCCL allreduce busBW within one node
    inter_bus_gbps: float  # GB/s, NCCL allreduce busBW across nodes

    def bus_bw(self, nodes: int) -> float:
        return (self.intra_bus_gbps if nodes == 1 else self.inter_bus_gbps) * GB


@dataclass(frozen=True)
class Workload:
    """One worker's step: its compute time and the bytes it allreduces."""

    step_s: float
    grad_bytes: float

    @classmethod
    def from_throughput(cls, images_per_s: float, batch: int, grad_bytes: float) -> Workload:
        return cls(step_s=batch / images_per_s, grad_bytes=grad_bytes)


def ring_allreduce_s(nbytes: float, workers: int, bus_bw: float) -> float:
    """Bandwidth term of a ring allreduce of ``nbytes`` on ``workers`` at ``bus_bw`` bytes/s."""
    if workers < 1 or bus_bw <= 0:
        raise ValueError("need at least one worker and a positive bandwidth")
    return 2 * (workers - 1) / workers * nbytes / bus_bw


def efficiency(
    work: Workload,
    workers: int,
    bus_bw: float,
    overlap: float = DEFAULT_OVERLAP,
    alpha_s: float = DEFAULT_ALPHA_S,
    fusion_bytes: float = DEFAULT_FUSION_BYTES,
) -> float:
    """Predicted scaling efficiency (aggregate rate over ``workers`` x the single-worker rate)."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be within [0, 1], got {overlap}")
    if workers == 1:
        return 1.0
    buckets = math.ceil(work.grad_bytes / fusion_bytes)
    latency = buckets * 2 * math.ceil(math.log2(workers)) * alpha_s
    exposed = max(0.0, ring_allreduce_s(work.grad_bytes, workers, bus_bw) - overlap * work.step_s) + latency
    return work.step_s / (work.step_s + exposed)


def cluster_efficiency(work: Workload, cluster: Cluster, nodes: int, **kwargs: float) -> float:
    return efficiency(work, nodes * cluster.gpus_per_node, cluster.bus_bw(nodes), **kwargs)


def implied_bus_gbps(work: Workload, workers: int, measured_efficiency: float, overlap: float = 0.0) -> float:
    """The busBW (GB/s) at which the model, with no latency term, reproduces a measured efficiency.

    A low value says the published run lost more than its network explains (or had less).
    """
    if not 0 < measured_efficiency <= 1:
        raise ValueError("efficiency must be within (0, 1]")
    exposed = work.step_s * (1 / measured_efficiency - 1)
    comm = exposed + overlap * work.step_s
    if comm <= 0:
        return math.inf
    return 2 * (workers - 1) / workers * work.grad_bytes / comm / GB


@dataclass(frozen=True)
class Anchor:
    """A published scaling result and what the model needs to reproduce it."""

    name: str
    single_images_s: float  # per GPU, one GPU
    workers: int
    aggregate_images_s: float
    batch: int
    params: int
    grad_bytes_per_param: int
    cluster: Cluster
    source: str

    @property
    def measured_efficiency(self) -> float:
        return self.aggregate_images_s / (self.workers * self.single_images_s)

    @property
    def workload(self) -> Workload:
        return Workload.from_throughput(self.single_images_s, self.batch, self.params * self.grad_bytes_per_param)

    def predicted(self, overlap: float = DEFAULT_OVERLAP) -> float:
        nodes = math.ceil(self.workers / self.cluster.gpus_per_node)
        return efficiency(self.workload, self.workers, self.cluster.bus_bw(nodes), overlap=overlap)


# Published bus bandwidths (GB/s). NC24rs_v3: 4 V100 on PCIe, one 56 Gb/s FDR link per node.
# DGX A100: NVSwitch, nccl-tests allreduce busBW about 230 GB/s. ND H100 v5: NVSwitch about
# 480 GB/s in a node, 8 x 400 Gb/s NDR rails, Azure's published multi-node busBW at least 450.
NC24RS_V3 = Cluster("NC24rs_v3 (4x V100, FDR IB)", 4, intra_bus_gbps=10.0, inter_bus_gbps=6.0)
DGX_A100 = Cluster("DGX A100 (8x A100, NVSwitch)", 8, intra_bus_gbps=230.0, inter_bus_gbps=180.0)
ND_H100_V5 = Cluster("ND96isr_H100_v5 (8x H100, 8x NDR IB)", 8, intra_bus_gbps=480.0, inter_bus_gbps=450.0)
HOROVOD_P100 = Cluster("Horovod paper (4x P100, 25 Gb/s RoCE)", 4, intra_bus_gbps=10.0, inter_bus_gbps=2.8)

ANCHORS = (
    Anchor(
        "Reference architecture, ResNet-50, V100, 32 GPUs",
        357,
        32,
        6516,
        batch=64,
        params=RESNET50_PARAMS,
        grad_bytes_per_param=4,
        cluster=NC24RS_V3,
        source="Azure reference architecture benchmark (synthetic data)",
    ),
    Anchor(
        "NVIDIA ResNet-50 v1.5 PyTorch, A100 80GB AMP, 8 GPUs",
        2470,
        8,
        16621,
        batch=256,
        params=RESNET50_PARAMS,
        grad_bytes_per_param=4,
        cluster=DGX_A100,
        source="NVIDIA DeepLearningExamples performance table",
    ),
    Anchor(
        "Horovod paper, ResNet-101, P100, 512 GPUs",
        130,  # approximate single-P100 ResNet-101 rate, TF, batch 64
        512,
        0.90 * 512 * 130,  # published as 90% efficiency, not as a rate
        batch=64,
        params=44_549_160,
        grad_bytes_per_param=4,
        cluster=HOROVOD_P100,
        source="Sergeev & Del Balso 2018, Horovod (arXiv:1802.05799)",
    ),
)

# Planning input, not a measurement: the per-H100 goal for ResNet-50 bf16 at batch 256.
H100_PLANNING_IMAGES_S = 3500
H100_BATCH = 256


def h100_projection(
    nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), fp16_grads: bool = False
) -> list[tuple[int, float]]:
    """Predicted efficiency of ResNet-50 on N x ND H100 v5 nodes."""
    grad_bytes = RESNET50_PARAMS * (2 if fp16_grads else 4)
    work = Workload.from_throughput(H100_PLANNING_IMAGES_S, H100_BATCH, grad_bytes)
    return [(n, cluster_efficiency(work, ND_H100_V5, n)) for n in nodes]
