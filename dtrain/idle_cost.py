"""What a standing Azure cluster costs while no job runs, and what a cold start adds to a job (on the
operator's machine; `cost`, `status` and `demo` print it).

A job's own charge (run.json) is its allocation times its time. A cluster bills more than its jobs:
the head node, NFS server and its disks, jumpbox and registry bill every hour the stack stands, and a GPU
node bills from the moment Azure starts it (a cold start: about COLD_START_MINUTES before slurmd
registers) until Slurm deallocates it after autostopMinutes idle. `IdleCost` states both parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from dtrain import pricing
from dtrain.cluster.description import REPO_ROOT, ClusterDescription
from dtrain.errors import OperatorError
from infra.config import StackConfig

# A GPU node's cold start, from Azure's start to slurmd registering (issue 34: 10-20 minutes on the
# ubuntu-hpc image with its first-boot setup). An assumption, printed wherever it is used.
COLD_START_MINUTES = 15
GPU_ROWS = ("GPU nodes", "Spot GPU nodes")  # estimate rows that bill only while nodes run
CENT = Decimal("0.01")


@dataclass(frozen=True)
class IdleCost:
    standing_usd_per_hour: Decimal | None  # head, NFS server and disks, jumpbox, registry; None: unknown
    node_usd_per_hour: Decimal | None  # one on-demand GPU node
    nodes_on: int  # GPU nodes powered on (billing) now, or assumed running
    autostop_minutes: int | None  # idle minutes before Slurm deallocates a node; 0: never; None: unknown
    note: str | None = None  # said instead of the figures (the local cluster)
    storage: str = "NFS"  # the shared file system that bills with the head node: NFS or Lustre

    @property
    def per_hour(self) -> Decimal | None:
        """What the cluster bills per hour with no job running (the nodes on stay on until autostop)."""
        if self.standing_usd_per_hour is None or self.node_usd_per_hour is None:
            return None
        return self.standing_usd_per_hour + self.nodes_on * self.node_usd_per_hour

    @property
    def tail_usd(self) -> Decimal | None:
        """The nodes on, idle until autostop deallocates them; None where they never stop or it is unknown."""
        if self.node_usd_per_hour is None or not self.autostop_minutes:
            return None
        return _round(self.nodes_on * self.node_usd_per_hour * self.autostop_minutes / 60)

    def describe(self) -> str:
        """One line: the standing part, the nodes on, and what they cost until autostop."""
        if self.note:
            return f"idle cost: {self.note}"
        parts = []
        if self.standing_usd_per_hour is not None:
            parts.append(
                f"${self.standing_usd_per_hour:,.2f}/hour for the head node, {self.storage}, jumpbox and registry"
            )
        if self.node_usd_per_hour is not None:
            word = "node" if self.nodes_on == 1 else "nodes"
            parts.append(f"${self.nodes_on * self.node_usd_per_hour:,.2f}/hour for {self.nodes_on} GPU {word} on")
        if self.standing_usd_per_hour is None:
            standing = f"the head node, {self.storage}, jumpbox and registry"
            parts.append(f"{standing} (`dtrain cost --stack-file` prices them)")
        total = "" if self.per_hour is None else f"${self.per_hour:,.2f}/hour: "
        line = f"idle cost: {total}{' + '.join(parts)}"
        if self.nodes_on and self.autostop_minutes == 0:
            return line + " (autostop is off: the nodes bill until they are stopped)"
        if self.nodes_on and self.tail_usd is not None:
            tail = f"${self.tail_usd:,.2f} until they stop after {self.autostop_minutes} idle minutes (autostop)"
            return f"{line}; {tail}"
        return line


def from_estimate(cfg: StackConfig, estimate: pricing.CostEstimate) -> IdleCost:
    """The idle cost of the estimate's stack: every row but the GPU nodes', and its running GPU nodes."""
    standing = sum((row.usd_per_hour for row in estimate.rows if not row.item.startswith(GPU_ROWS)), Decimal(0))
    node = estimate.table.require("vm_hourly", cfg.gpu_sku, cfg.location).usd
    running = sum(row.count for row in estimate.rows if row.item == "GPU nodes, running")  # Spot: not here
    storage = "Lustre" if cfg.shared_storage == "lustre" else "NFS"
    return IdleCost(standing, node, running, cfg.autostop_minutes, storage=storage)


def for_stack_file(path: Path, nodes_on: int) -> IdleCost | None:
    """The idle cost of a stack whose stack file is at path with nodes_on GPU nodes on; None where the
    file or its prices cannot be read (`status` then prints no figure rather than fail)."""
    if not path.is_file():
        return None
    try:
        cfg = pricing.read_stack_config(path)
        estimate = pricing.estimate_cost(cfg, pricing.load_price_table(), 0)
    except OperatorError:
        return None
    standing = from_estimate(cfg, estimate).standing_usd_per_hour
    return IdleCost(standing, _node_price(cfg), nodes_on, cfg.autostop_minutes)


def for_cluster(desc: ClusterDescription, nodes_on: int) -> IdleCost:
    """A cluster's idle cost with nodes_on GPU nodes powered on: from its stack file (Pulumi.<name>.yaml,
    the stack `cluster from-stack` read) where it is at hand, else the GPU nodes' part alone."""
    if desc.provider == "local":
        return IdleCost(Decimal(0), Decimal(0), nodes_on, None, "$0 (local cluster: no charge)")
    found = for_stack_file(REPO_ROOT / f"Pulumi.{desc.name}.yaml", nodes_on)
    if found is not None:
        return found
    price = pricing.node_hour_price(desc.gpu_sku, desc.region) if desc.gpu_sku and desc.region else None
    return IdleCost(None, None if price is None else price.usd_per_hour, nodes_on, None)


def _node_price(cfg: StackConfig) -> Decimal | None:
    price = pricing.node_hour_price(cfg.gpu_sku, cfg.location)
    return None if price is None else price.usd_per_hour


@dataclass(frozen=True)
class ColdStart:
    """A job on a cluster started cold for it: nodes boot, the job runs, the nodes idle until autostop,
    and the standing part bills throughout."""

    job_usd: Decimal
    boot_usd: Decimal
    tail_usd: Decimal
    standing_usd: Decimal

    @property
    def total(self) -> Decimal:
        return self.job_usd + self.boot_usd + self.tail_usd + self.standing_usd


def cold_start(idle: IdleCost, billed_node_hours: float, job_seconds: float) -> ColdStart | None:
    """The cost of a job of billed_node_hours run for job_seconds on idle.nodes_on nodes started for it."""
    node, standing = idle.node_usd_per_hour, idle.standing_usd_per_hour
    if node is None or standing is None:
        return None
    boot_hours = Decimal(COLD_START_MINUTES) / 60
    tail_hours = Decimal(idle.autostop_minutes or 0) / 60
    hours = boot_hours + Decimal(str(job_seconds)) / 3600 + tail_hours
    return ColdStart(
        job_usd=_round(node * Decimal(str(billed_node_hours))),
        boot_usd=_round(idle.nodes_on * node * boot_hours),
        tail_usd=_round(idle.nodes_on * node * tail_hours),
        standing_usd=_round(standing * hours),
    )


def _round(value: Decimal) -> Decimal:
    return value.quantize(CENT, ROUND_HALF_UP)
