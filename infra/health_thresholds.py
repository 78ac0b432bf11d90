"""The one table of node health thresholds: what a healthy node of each kind measures, and where the
figure comes from. Read by the node's boot and periodic checks (rendered onto the node by
infra/cloud_init) and by the gate before every multi-node job (dtrain/jobs/node_gate.py passes the
figures to dtrain/remote/job/node_gate.py). Imports without Pulumi.

Sources (Azure's own checks for its sizes): Azure/azurehpc-health-checks, installed on the ubuntu-hpc
image as /opt/azurehpc/test/azurehpc-health-checks (azhpc-images components/install_health_checks.sh,
version 0.4.5 in its versions.json), one configuration per size, conf/<azure_checks_conf>.conf; the
node runs it at every boot (infra/cloud_init/azure_checks.py). Each of the four sizes here has one,
and each checks 8 InfiniBand ports, `check_hw_ib <rate> mlx5_ib0:1` .. `mlx5_ib7:1`: 400 Gb/s on
nd96isr_h100_v5 and nd96isr_h200_v5 (NDR), 200 Gb/s on nd96asr_v4 and nd96amsr_a100_v4 (HDR), which
the periodic health check counts too (infiniband_ports, infiniband_rate_gbps). Their other figures:
for ND96isr_H100_v5, a single-node NCCL all-reduce of at least 460 GB/s bus bandwidth at 16 GB
(`check_nccl_allreduce 460.0 1 16G`), GPUDirect RDMA write of at least 380 Gb/s per port
(`check_ib_bw_gdr 380`; the issue that asked for this quoted 375), host-to-device copies of at least
48 GB/s (`check_gpu_bw 48 335`; its README says 52); for nd96isr_h200_v5, all-reduce of 431 GB/s and
GPUDirect RDMA write of 360 Gb/s per port; for both ND A100 v4 sizes, all-reduce of 228 GB/s
(`check_nccl_allreduce 228.0`, 8G on nd96asr_v4, 16G on nd96amsr_a100_v4) and GPUDirect RDMA write of
180 Gb/s per port (`check_ib_bw_gdr 180.0`). Its multi-node baseline for ND H100 v5 is about 450 GB/s
all-reduce bus bandwidth on 8 nodes, a warning below 400 and a report below 300; a 2-node figure near
half the expected one means one bad node.

The gate's figures are smaller than Azure's because it must take seconds, not minutes: its messages
are 256 MiB on GPUs (not 16 GB), where NCCL's bus bandwidth is lower, so each GPU threshold is Azure's
figure times GATE_SHARE. Those GPU figures are derived, not yet measured on a card by this project
(docs/performance.md records the figures of each GPU window). The local cluster's figures (CPU nodes,
gloo over veth pairs) are set an order of magnitude under what a loaded 2-core machine measures, so
that only a node made slow on purpose (`local link-rate`, a CPU cgroup limit) fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# A healthy node's gate figure is at least this share of Azure's own threshold (see above).
GATE_SHARE = 0.5


@dataclass(frozen=True)
class GateThresholds:
    """What each node must measure in the gate before a multi-node job (dtrain/remote/job/node_gate.py)."""

    # The node's own figure: "allreduce" (GPU nodes: NCCL all-reduce across the node's GPUs, bus
    # bandwidth in GB/s) or "matmul" (CPU nodes: one core's float32 matrix product, GFLOP/s).
    node_figure: str
    node_min: float
    link_min_gbs: float  # GB/s each node sends to the next node of a ring (one port's path on GPUs)
    job_allreduce_min_gbs: float  # bus bandwidth of an all-reduce across exactly the job's nodes
    message_mib: int  # the size of each measured message


@dataclass(frozen=True)
class NodeHealth:
    """A node kind's thresholds: the boot and periodic checks', and the gate's."""

    azure_checks_conf: str | None  # azurehpc-health-checks' conf/<name>.conf for the size; None: not one of Azure's
    infiniband_ports: int  # InfiniBand ports that must be ACTIVE (0: no InfiniBand check)
    infiniband_rate_gbps: int  # the rate each of them must run at (0: any)
    gate: GateThresholds


_ND_V5_GATE = GateThresholds(
    node_figure="allreduce",
    node_min=460 * GATE_SHARE,
    link_min_gbs=380 / 8 * GATE_SHARE,  # 380 Gb/s GPUDirect RDMA per port, in GB/s
    job_allreduce_min_gbs=300 * GATE_SHARE,  # Azure's report line for ND H100 v5
    message_mib=256,
)
_ND_H200_V5_GATE = replace(_ND_V5_GATE, node_min=431 * GATE_SHARE, link_min_gbs=360 / 8 * GATE_SHARE)
_ND_V4_GATE = GateThresholds(
    node_figure="allreduce",
    node_min=228 * GATE_SHARE,  # NVLink 3: half of ND v5's NVLink 4 figure
    link_min_gbs=180 / 8 * GATE_SHARE,  # 200 Gb/s HDR ports: 180 Gb/s GPUDirect RDMA each, in GB/s
    job_allreduce_min_gbs=150 * GATE_SHARE,
    message_mib=256,
)

NODE_HEALTH: dict[str, NodeHealth] = {
    "Standard_ND96isr_H100_v5": NodeHealth("nd96isr_h100_v5", 8, 400, _ND_V5_GATE),
    "Standard_ND96isr_H200_v5": NodeHealth("nd96isr_h200_v5", 8, 400, _ND_H200_V5_GATE),
    "Standard_ND96amsr_A100_v4": NodeHealth("nd96amsr_a100_v4", 8, 200, _ND_V4_GATE),
    "Standard_ND96asr_v4": NodeHealth("nd96asr_v4", 8, 200, _ND_V4_GATE),
}

# The local cluster's CPU nodes (network namespaces on one machine, gloo over veth pairs).
LOCAL_HEALTH = NodeHealth(
    azure_checks_conf=None,
    infiniband_ports=0,
    infiniband_rate_gbps=0,
    gate=GateThresholds(
        node_figure="matmul",
        node_min=0.5,  # GFLOP/s of one core; a loaded 2-core machine measures 10 or more
        # 8 Mbit/s. Veth pairs carry gigabits, but on a loaded machine a transfer's time is mostly the
        # wait for a core (up to half a second at load 16): 1 MiB then still measures 2 MB/s or more.
        link_min_gbs=0.001,
        job_allreduce_min_gbs=0.0005,
        message_mib=1,
    ),
)


def node_health(vm_size: str) -> NodeHealth:
    """The thresholds of an InfiniBand GPU size (infra/skus.py's table has the same keys)."""
    return NODE_HEALTH[vm_size]
