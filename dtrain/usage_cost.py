"""Who ran what, and what it cost: each person's (or Slurm account's) jobs since a date, from Slurm's
accounting (`sacct` on the login node, over SSH), in node-hours, GPU-hours and dollars at the price table's
price (`cost --by user|account`). Runs on the operator's machine.

A job's hours are its allocation's within the window: from its start (or the window's) to its end (or now,
while it runs), times its nodes (NNodes) and its GPUs (AllocTRES gres/gpu). It is charged as run.json charges
it (dtrain/remote/job/record_run.py): its GPUs' share of its nodes, or on nodes without GPUs its CPUs' share,
and whole nodes where it holds every CPU of them (--exclusive), at the on-demand price per node-hour, or the
Spot price for a job that ran in the Spot partition. On the local cluster prices are $0 and the hours real.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Literal

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import Slurm
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.submit import node_hour_price
from dtrain.pricing import QUANTUM

Grouping = Literal["user", "account"]
HOURS = Decimal("0.0001")  # each row's hours are rounded once, to this; the total sums the rounded rows
_FIELDS = "jobid,user,account,partition,nnodes,alloctres,start,end"


@dataclass(frozen=True)
class JobUsage:
    """One job's allocation within the window, as sacct recorded it."""

    job_id: str
    user: str
    account: str
    partition: str
    nodes: int
    gpus: int
    cpus: int
    seconds: int


@dataclass(frozen=True)
class UsageRow:
    """One person's (or account's) jobs, added up."""

    name: str
    jobs: int
    node_hours: Decimal
    gpu_hours: Decimal
    billed_node_hours: Decimal
    usd: Decimal | None  # None where a job ran in a partition whose price is not known


def check_since(text: str) -> datetime:
    """--since: a date or a date and time (UTC), not in the future."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise OperatorError(f"{text!r} is not a date: give YYYY-MM-DD or YYYY-MM-DDTHH:MM (UTC)") from None
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    if moment > datetime.now(UTC):
        raise OperatorError(f"{text} is in the future: nothing has run since")
    return moment


def month_start(now: datetime | None = None) -> datetime:
    """The 1st of this month, 00:00 UTC: where the GPU-hour budgets' month begins (PriorityUsageResetPeriod)."""
    now = now or datetime.now(UTC)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def read_jobs(slurm: Slurm, since: datetime) -> tuple[list[JobUsage], datetime]:
    """Every job sacct shows you (everyone's, unless Slurm keeps others' private) that ran since `since`, and
    the login node's clock at the reading (what a running job's hours run to)."""
    start = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    script = (
        "date +%s && TZ=UTC SLURM_TIME_FORMAT=%s sacct --allusers --allocations --noheader --parsable2 "
        f"--starttime={start} --endtime=now --format={_FIELDS}"
    )
    result = slurm.run_unchecked(script, timeout=120)
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines or not lines[0].strip().isdigit():
        raise OperatorError(
            f"sacct on the login node failed (is Slurm's accounting up?): {result.stderr.strip()[-400:]}",
            ExitCode.FAILED,
        )
    now = int(lines[0])
    jobs = [_job(line, int(since.timestamp()), now) for line in lines[1:]]
    return [job for job in jobs if job is not None], datetime.fromtimestamp(now, UTC)


def _job(line: str, since: int, now: int) -> JobUsage | None:
    """A sacct line as a JobUsage; None for a job that never started (its Start is Unknown or None)."""
    fields = line.split("|")
    if len(fields) != 8 or not fields[6].isdigit():
        return None
    job_id, user, account, partition, nodes, tres, started, ended = fields
    end = int(ended) if ended.isdigit() else now  # Unknown while it runs
    counts = dict(item.split("=", 1) for item in tres.split(",") if "=" in item)
    return JobUsage(
        job_id=job_id,
        user=user,
        account=account,
        partition=partition,
        nodes=int(nodes) if nodes.isdigit() else 0,
        gpus=_whole(counts.get("gres/gpu")),
        cpus=_whole(counts.get("cpu")),
        seconds=max(0, end - max(int(started), since)),
    )


def _whole(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def billed_nodes(job: JobUsage, node_gpus: int, node_cpus: int | None) -> Decimal:
    """The node-equivalents a job is charged: record_run.py's rule, from sacct's figures."""
    if node_cpus and job.cpus >= job.nodes * node_cpus:
        return Decimal(job.nodes)  # every CPU of its nodes: it holds them whole
    if node_gpus:
        return Decimal(job.gpus) / node_gpus
    if node_cpus:
        return Decimal(job.cpus) / node_cpus
    return Decimal(job.nodes)


def partition_prices(desc: ClusterDescription) -> dict[str, Decimal | None]:
    """partition -> USD per node-hour: the on-demand price, and the Spot price for the Spot partition."""
    access = desc.slurm
    if access is None:
        return {}
    prices = {access.partition: node_hour_price(desc)[0]}
    if access.spot_partition:
        prices[access.spot_partition] = node_hour_price(desc, spot=True)[0]
    return {name: None if price is None else Decimal(str(price)) for name, price in prices.items()}


def add_up(
    jobs: Sequence[JobUsage], by: Grouping, desc: ClusterDescription, prices: dict[str, Decimal | None]
) -> list[UsageRow]:
    """One row per person (or account), most GPU-hours first."""
    groups: dict[str, list[JobUsage]] = {}
    for job in jobs:
        groups.setdefault(job.user if by == "user" else job.account, []).append(job)
    rows = [_row(name, members, desc, prices) for name, members in groups.items()]
    return sorted(rows, key=lambda row: (-row.gpu_hours, -row.node_hours, row.name))


def _row(name: str, jobs: Sequence[JobUsage], desc: ClusterDescription, prices: dict[str, Decimal | None]) -> UsageRow:
    hours = [Decimal(job.seconds) / 3600 for job in jobs]
    billed = [billed_nodes(job, desc.gpus_per_node, desc.node_cpus) * h for job, h in zip(jobs, hours, strict=True)]
    costs = [prices.get(job.partition) for job in jobs]
    usd = None
    if all(price is not None for price in costs):
        usd = sum((b * p for b, p in zip(billed, costs, strict=True) if p is not None), Decimal(0))
    return UsageRow(
        name=name,
        jobs=len(jobs),
        node_hours=_hours(sum((job.nodes * h for job, h in zip(jobs, hours, strict=True)), Decimal(0))),
        gpu_hours=_hours(sum((job.gpus * h for job, h in zip(jobs, hours, strict=True)), Decimal(0))),
        billed_node_hours=_hours(sum(billed, Decimal(0))),
        usd=None if usd is None else usd.quantize(QUANTUM, ROUND_HALF_UP),
    )


def _hours(value: Decimal) -> Decimal:
    return value.quantize(HOURS, ROUND_HALF_UP)


def total(rows: Sequence[UsageRow]) -> UsageRow:
    usd = [row.usd for row in rows]
    return UsageRow(
        name="total",
        jobs=sum(row.jobs for row in rows),
        node_hours=sum((row.node_hours for row in rows), Decimal(0)),
        gpu_hours=sum((row.gpu_hours for row in rows), Decimal(0)),
        billed_node_hours=sum((row.billed_node_hours for row in rows), Decimal(0)),
        usd=None if None in usd else sum((u for u in usd if u is not None), Decimal(0)),
    )
