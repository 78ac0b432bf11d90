"""The `cost` command: its flags, the table and the JSON document, over dtrain/pricing.py (the price
table, the estimate, the Azure Retail Prices API); with --by, what each person or account used and what
it cost, over dtrain/usage_cost.py (Slurm's accounting)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from decimal import Decimal
from pathlib import Path

from rich.table import Table

from dtrain.cli_entry import add_cluster_option, arg_type, int_between, non_empty
from dtrain.cluster.description import load
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH
from dtrain.errors import OperatorError
from dtrain.idle_cost import IdleCost, from_estimate
from dtrain.jobs.submit import node_hour_price
from dtrain.json_documents import CostDocument, CostIdle, CostItem, CostPrices, UsageCostDocument, UsageCostRow
from dtrain.pricing import (
    DEFAULT_CACHE,
    DEFAULT_STACK_FILE,
    NOT_INCLUDED,
    PRICES_FILE,
    CostEstimate,
    count_nodes,
    estimate_cost,
    load_price_table,
    read_live_nodes,
    read_stack_config,
    refresh_prices,
    running_nodes,
    save_price_table,
    shown_path,
    wanted_prices,
)
from dtrain.ui import make_console
from dtrain.usage_cost import UsageRow, add_up, check_since, month_start, partition_prices, read_jobs, total
from infra.skus import GPU_SKUS

DESCRIPTION = """\
The hourly cost of the Azure stack that a Pulumi stack file describes, before or after `pulumi up`:
GPU nodes (those Slurm has power-saved are deallocated and cost $0), the head node, the NFS server
and its Premium SSD data disks, the jumpbox and the container registry. Prices are Azure's
pay-as-you-go Linux list prices in USD from a dated table (infra/data/prices.json), or live from
the Azure Retail Prices API with --refresh. Blob storage, egress and OS disks are not included.
It ends with the idle cost: what the standing cluster bills per hour with no job running (the head node,
NFS, jumpbox and registry always; the GPU nodes running until Slurm deallocates them after
autostopMinutes idle), and what those nodes cost until then.

With --by user|account: who ran what and what it cost, on a running cluster (the cluster description,
--cluster FILE), from Slurm's accounting (sacct): each person's or account's jobs since --since, their
node-hours (nodes x time), GPU-hours (GPUs x time) and cost, charged as run.json charges a run (the GPUs'
share of their nodes, whole nodes for --exclusive) at the price table's price per node-hour of the
cluster's GPU size, Spot jobs at the Spot price. The local cluster's prices are $0; its hours are real."""
EXAMPLES = """\
examples:
  python -m dtrain cost                                   # Pulumi.dev.yaml, every GPU node running
  python -m dtrain cost --running-nodes 0                 # all GPU nodes power-saved (idle cluster)
  python -m dtrain cost --live                            # the GPU nodes as the cluster's Slurm holds them now
  python -m dtrain cost --stack-file Pulumi.prod.yaml --json
  python -m dtrain cost --refresh --save                  # live prices, kept in ~/.cache/azure-horovod
  python -m dtrain cost --prices ~/.cache/azure-horovod/prices.json
  python -m dtrain cost --by user                         # this month's jobs, per person (the cluster's sacct)
  python -m dtrain cost --by account --since 2026-01-01 --json
"""
PRICES_HELP = f"price table to read (default: {shown_path(PRICES_FILE)})"


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "cost",
        help="the stack's hourly cost, from its stack file and a dated price table",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_stack_file_option(parser)
    nodes = parser.add_mutually_exclusive_group()
    nodes.add_argument(
        "--running-nodes",
        type=int_between(0),
        metavar="N",
        help="GPU nodes up (default: all, nodeCount); the rest are power-saved at $0",
    )
    nodes.add_argument(
        "--live",
        action="store_true",
        help="count the GPU nodes as the cluster's Slurm holds them now (the cluster description: --cluster FILE): "
        "running, power-saved, and deallocated for never registering",
    )
    add_cluster_option(parser)
    parser.add_argument(
        "--by",
        choices=("user", "account"),
        help="what the cluster's jobs used and cost, per person or Slurm account, from its accounting (sacct)",
    )
    parser.add_argument(
        "--since",
        type=arg_type(check_since),
        metavar="DATE",
        help="with --by: the jobs since DATE, YYYY-MM-DD or YYYY-MM-DDTHH:MM in UTC (default: the 1st of this "
        "month, 00:00, where the GPU-hour budgets' month begins)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prices", type=non_empty, metavar="FILE", help=PRICES_HELP)
    source.add_argument("--refresh", action="store_true", help="read live prices from the Azure Retail Prices API")
    parser.add_argument(
        "--full-table",
        action="store_true",
        help="with --refresh: every size, tier and common region the shipped table covers, not only this stack's",
    )
    parser.add_argument(
        "--save",
        nargs="?",
        const=str(DEFAULT_CACHE),
        type=non_empty,
        metavar="FILE",
        help=f"with --refresh: also write the prices read to FILE (default: {DEFAULT_CACHE}) for a later --prices",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (amounts as exact decimal strings; an error document on failure)",
    )
    parser.set_defaults(handler=run_cost)


def add_stack_file_option(parser: argparse.ArgumentParser, what: str = "") -> None:
    """--stack-file: the Pulumi stack file that `cost` and `doctor` read before anything is deployed."""
    parser.add_argument(
        "--stack-file",
        type=non_empty,
        default=str(DEFAULT_STACK_FILE),
        metavar="FILE",
        help=f"Pulumi stack file{what} (default: {shown_path(DEFAULT_STACK_FILE)})",
    )


def run_cost(args: argparse.Namespace) -> int:
    if args.by:
        return run_cost_by(args)
    if args.since:
        raise OperatorError("--since goes with --by (the jobs since a date)")
    if (args.save or args.full_table) and not args.refresh:
        raise OperatorError("--save and --full-table go with --refresh (they keep or widen what it reads)")
    stack_file = Path(args.stack_file).expanduser()
    cfg = read_stack_config(stack_file)
    running_nodes(cfg, args.running_nodes)  # bad input is refused before any request goes out
    if args.refresh:
        table = refresh_prices(*wanted_prices(cfg, args.full_table))
        if args.save:
            print(f"wrote {save_price_table(table, Path(args.save).expanduser())}", file=sys.stderr)
    else:
        table = load_price_table(Path(args.prices).expanduser() if args.prices else PRICES_FILE)
    live = count_nodes(cfg, read_live_nodes(getattr(args, "cluster", None))) if args.live else None
    estimate = estimate_cost(cfg, table, args.running_nodes, live)
    idle = from_estimate(cfg, estimate)
    if args.json:
        _as_document(estimate, stack_file, idle).print()
    else:
        _print_table(estimate, stack_file)
        out = make_console(stderr=False)
        out.print(idle.describe(), highlight=False)
        out.print(_gpu_hour_line(cfg.gpu_sku, idle), highlight=False)
    return 0


def run_cost_by(args: argparse.Namespace) -> int:
    """Who ran what since --since, and what it cost."""
    stack_only = [flag for flag, given in (("--running-nodes", args.running_nodes is not None), ("--live", args.live),
                  ("--refresh", args.refresh), ("--prices", args.prices)) if given]  # fmt: skip
    if stack_only:
        verb = "goes" if len(stack_only) == 1 else "go"
        raise OperatorError(f"{', '.join(stack_only)} {verb} without --by (it prices the stack file, not the jobs)")
    since = args.since or month_start()
    desc = load(getattr(args, "cluster", None))
    with SSH(desc) as ssh:
        jobs, until = read_jobs(Slurm(desc, ssh), since)
    rows = add_up(jobs, args.by, desc, partition_prices(desc))
    prices = node_hour_price(desc)[1]
    if args.json:
        UsageCostDocument(
            by=args.by, cluster=desc.name, since=_iso(since), until=_iso(until), currency="USD", prices=prices,
            rows=[_usage_row(row) for row in rows], total=_usage_row(total(rows)),
        ).print()  # fmt: skip
        return 0
    table = Table(title=f"{desc.name}: jobs by {args.by}, {_iso(since)} to {_iso(until)} (sacct)")
    for column in (args.by, "jobs", "node-hours", "GPU-hours", "billed node-hours", "cost (USD)"):
        table.add_column(column, justify="left" if column == args.by else "right")
    for row in [*rows, total(rows)]:
        if row.name == "total":
            table.add_section()
        usd = "unknown" if row.usd is None else f"${row.usd:,.2f}"
        cells = (str(row.jobs), f"{row.node_hours:,.4f}", f"{row.gpu_hours:,.4f}", f"{row.billed_node_hours:,.4f}", usd)
        table.add_row(row.name, *cells, style="bold" if row.name == "total" else None)
    out = make_console(stderr=False)
    out.print(table)
    out.print(
        f"Prices: {prices}; Spot jobs at the Spot price. Billed: the GPUs' share of their nodes.", highlight=False
    )
    return 0


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _usage_row(row: UsageRow) -> UsageCostRow:
    return UsageCostRow(
        name=row.name,
        jobs=row.jobs,
        node_hours=str(row.node_hours),
        gpu_hours=str(row.gpu_hours),
        billed_node_hours=str(row.billed_node_hours),
        usd=None if row.usd is None else str(row.usd),
    )


def _gpu_hour_line(sku: str, idle: IdleCost) -> str:
    """What a job pays: its share of a node, as `launch` quotes it and run.json charges it."""
    gpus = GPU_SKUS[sku].gpus_per_node
    per_gpu = (idle.node_usd_per_hour or Decimal(0)) / gpus
    return (
        f"a job pays for the GPUs it holds: ${idle.node_usd_per_hour:,.2f}/node-hour / {gpus} GPUs = "
        f"${per_gpu:,.4f}/GPU-hour (what `launch` quotes and run.json charges; whole nodes for --exclusive)"
    )


def _money(value: Decimal) -> str:
    return f"${value:,.4f}"


def _print_table(estimate: CostEstimate, stack_file: Path) -> None:
    table = Table(title=f"Hourly cost of {shown_path(stack_file)} in {estimate.region} (USD)")
    for column in ("item", "size", "count", "unit price"):
        table.add_column(column, justify="right" if column == "count" else "left")
    table.add_column("per hour", justify="right")
    for row in estimate.rows:
        table.add_row(row.item, row.size, str(row.count), row.basis, _money(row.usd_per_hour))
    table.add_section()
    table.add_row("total", "", "", "", _money(estimate.total), style="bold")
    out = make_console(stderr=False)
    out.print(table)
    prices = estimate.table
    out.print(f"Prices: {prices.origin}, {prices.price_type}, USD: {prices.source}.", highlight=False)
    for row in estimate.rows:
        if row.quote and row.quote.estimate:
            out.print(f"  estimated: {row.item}, {row.size}: {row.quote.estimate}", highlight=False)
    for key in estimate.sources:
        out.print(f"  [{key}] {prices.describe_source(key)}", highlight=False, markup=False)
    out.print(f"Not included: {'; '.join(NOT_INCLUDED)}.", highlight=False)


def _as_document(estimate: CostEstimate, stack_file: Path, idle: IdleCost) -> CostDocument:
    prices = estimate.table
    return CostDocument(
        stack_file=str(stack_file),
        region=estimate.region,
        currency="USD",
        prices=CostPrices(
            table=prices.origin,
            as_of=str(prices.as_of),
            price_type=prices.price_type,
            source=prices.source,
            query=prices.query,
        ),
        rows=[
            CostItem(
                item=row.item,
                size=row.size,
                count=row.count,
                basis=row.basis,
                usd_per_hour=str(row.usd_per_hour),
                source=prices.describe_source(row.quote.source) if row.quote else None,
                estimate=row.quote.estimate if row.quote else None,
            )
            for row in estimate.rows
        ],
        total_usd_per_hour=str(estimate.total),
        idle=CostIdle(
            standing_usd_per_hour=str(idle.standing_usd_per_hour),
            gpu_node_usd_per_hour=str(idle.node_usd_per_hour),
            gpu_nodes_on=idle.nodes_on,
            usd_per_hour=str(idle.per_hour),
            autostop_minutes=idle.autostop_minutes or 0,
            until_autostop_usd=None if idle.tail_usd is None else str(idle.tail_usd),
        ),
        not_included=list(NOT_INCLUDED),
    )
