"""What the Azure stack costs per hour, from its stack file and a dated price table (on the operator's
machine; `dtrain/cli/cost.py` is the `cost` command over it).

The rows are what `pulumi up` deploys: the GPU nodes Slurm keeps running (power-saved nodes are
deallocated and cost nothing), the head node, the shared file system (the NFS server and its Premium SSD
data disks, or Azure Managed Lustre: its capacity times its tier's price per TiB-hour), the jumpbox and
the container registry. Usage-based charges (blob storage, egress) are not in it.

Prices come from infra/data/prices.json: Azure Retail Prices API figures (Consumption, Linux,
pay-as-you-go, USD) with the date and source of each. `--refresh` reads the live API instead, for
exactly the sizes and region the stack uses; `--save [FILE]` keeps what it read for a later
`--prices FILE`. To regenerate the shipped table (where prices.azure.com can be reached):

    python -m dtrain cost --refresh --full-table --save infra/data/prices.json

which reads every allow-listed GPU size, the default jumpbox, head and NFS sizes, every Premium SSD
tier and the registry SKU in COMMON_REGIONS, and writes them with the API as their one source.

With `--live`, the GPU rows count the nodes as the cluster's Slurm holds them now (over SSH, from the
cluster description): running, power-saved, and deallocated for never registering (the head node's
reaper, dtrain/remote/slurm/slurm_power.py), which `status` lists with the reason.

For a run's record, `node_hour_price(sku, region)` is the price of one GPU node-hour.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_serializer, model_validator

from dtrain.checks import describe_validation_error, ensure_directory, read_json_file, read_text_file
from dtrain.cluster.description import load
from dtrain.cluster.slurm import NodeInfo, Slurm
from dtrain.cluster.ssh import SSH
from dtrain.errors import ExitCode, OperatorError, explain_os_error
from dtrain.fileio import atomic_write
from infra.config import ConfigError, StackConfig, parse_config
from infra.contract import REGISTRY_SKU
from infra.skus import GPU_SKUS

REPO_ROOT = Path(__file__).resolve().parents[1]
PRICES_FILE = REPO_ROOT / "infra" / "data" / "prices.json"
DEFAULT_STACK_FILE = REPO_ROOT / "Pulumi.dev.yaml"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "azure-horovod" / "prices.json"
RETAIL_PRICES_URL = "https://prices.azure.com/api/retail/prices"
RETAIL_PRICES_URL_ENV = "AZURE_RETAIL_PRICES_URL"  # tests point it at a local server
PRICE_TYPE = "Consumption, Linux, pay-as-you-go"
COMMON_REGIONS = (
    "eastus",
    "eastus2",
    "southcentralus",
    "westus2",
    "westus3",
    "westeurope",
    "northeurope",
    "uksouth",
    "swedencentral",
    "japaneast",
    "australiaeast",
)
# Azure bills a Premium SSD by the smallest tier that holds its size (GiB).
PREMIUM_SSD_TIERS = (
    ("P4", 32),
    ("P6", 64),
    ("P10", 128),
    ("P15", 256),
    ("P20", 512),
    ("P30", 1024),
    ("P40", 2048),
    ("P50", 4096),
    ("P60", 8192),
    ("P70", 16384),
    ("P80", 32767),
)
HOURS_PER_MONTH = Decimal(730)  # Azure's own convention for monthly prices
HOURS_PER_DAY = Decimal(24)
ZERO = Decimal("0.0000")
QUANTUM = Decimal("0.0001")  # each row is rounded once, to this; the total is the sum of the rounded rows
MAX_PAGES = 100  # a price query for a few sizes is one or two pages; more means a runaway NextPageLink
NOT_INCLUDED = (
    "OS disks of every VM (deallocated GPU nodes keep theirs)",
    "blob storage and egress (usage-based)",
    "the jumpbox's public IP, registry storage beyond the included amount, build minutes (az acr build)",
)

Section = Literal["vm_hourly", "vm_spot_hourly", "premium_ssd_monthly", "registry_daily", "lustre_tib_hourly"]
SECTION_NAMES: dict[Section, str] = {
    "vm_hourly": "VM size",
    "vm_spot_hourly": "Spot VM size",
    "premium_ssd_monthly": "Premium SSD tier",
    "registry_daily": "container registry SKU",
    "lustre_tib_hourly": "Azure Managed Lustre SKU",
}
# Where Azure lists Azure Managed Lustre's prices, for the figure a price file needs (--refresh reads none).
LUSTRE_PRICES_URL = "https://azure.microsoft.com/pricing/details/managed-lustre/"


# --- the price table -----------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Model):
    what: str
    url: str | None = None
    taken: date | None = None
    note: str | None = None


class Quote(_Model):
    """One price: USD per hour (VMs), per month (disks), per day (registry) or per TiB-hour (Lustre)."""

    usd: Decimal = Field(ge=0)
    source: str
    estimate: str | None = None  # why the figure is not a direct reading of the API

    @field_serializer("usd", when_used="json")
    def _as_number(self, value: Decimal) -> float:
        return float(value)  # the shortest float repr round-trips a price's few digits exactly


class PriceTable(_Model):
    about: str = ""
    as_of: date
    source: str
    query: str = ""  # the API's $filter the figures answer
    currency: Literal["USD"]
    price_type: Literal["Consumption, Linux, pay-as-you-go"]
    sources: dict[str, Source]
    vm_hourly: dict[str, dict[str, Quote]]
    vm_spot_hourly: dict[str, dict[str, Quote]] = Field(default_factory=dict)  # Spot: list price, moves daily
    premium_ssd_monthly: dict[str, dict[str, Quote]]
    registry_daily: dict[str, dict[str, Quote]]
    # Azure Managed Lustre (sharedStorage lustre), per TiB of capacity and hour, by SKU name: never read by
    # --refresh, whose meters for it were not at hand to check; a price file adds it (docs/operator.md, "Cost")
    lustre_tib_hourly: dict[str, dict[str, Quote]] = Field(default_factory=dict)
    _origin: str = PrivateAttr(default="the price table")

    @model_validator(mode="after")
    def _sources_known(self) -> PriceTable:
        unknown = {q.source for s in SECTION_NAMES for q in self._quotes(s)} - set(self.sources)
        if unknown:
            raise ValueError(f"quotes name sources not listed under `sources`: {', '.join(sorted(unknown))}")
        return self

    @property
    def origin(self) -> str:
        """Where the table was read from, for messages: its file and date, or the live API."""
        return self._origin

    def _quotes(self, section: Section) -> Iterable[Quote]:
        return (quote for regions in getattr(self, section).values() for quote in regions.values())

    def lookup(self, section: Section, name: str, region: str) -> Quote | None:
        return getattr(self, section).get(name, {}).get(region)

    def require(self, section: Section, name: str, region: str) -> Quote:
        """The quote, or an error that says where the table does have this name."""
        if (quote := self.lookup(section, name, region)) is not None:
            return quote
        regions = sorted(getattr(self, section).get(name, {}))
        where = f"it has {name} in {', '.join(regions)}" if regions else f"it has no price for {name} in any region"
        raise OperatorError(
            f"{self._origin} has no price for {SECTION_NAMES[section]} {name} in {region} ({where}); "
            "run with --refresh to read the live price from the Azure Retail Prices API, or pass --prices FILE"
        )

    def describe_source(self, key: str) -> str:
        source = self.sources[key]
        taken = f", taken {source.taken}" if source.taken else ""
        return f"{source.what}{taken}" + (f" ({source.url})" if source.url else "")


def load_price_table(path: Path = PRICES_FILE) -> PriceTable:
    raw = read_json_file(path, "price table")
    try:
        table = PriceTable.model_validate(raw)
    except ValidationError as exc:
        raise OperatorError(f"price table {path} is not valid: {describe_validation_error(exc)}") from None
    table._origin = f"price table {shown_path(path)} (as of {table.as_of})"
    return table


def save_price_table(table: PriceTable, path: Path) -> Path:
    ensure_directory(path.parent, "the directory of --save")
    try:
        atomic_write(path, table.model_dump_json(indent=2, exclude_none=True) + "\n")
    except OSError as exc:
        raise explain_os_error(exc, "write the price table") from None
    return path


def premium_ssd_tier(size_gib: int) -> str:
    for tier, capacity in PREMIUM_SSD_TIERS:
        if size_gib <= capacity:
            return tier
    raise OperatorError(f"a {size_gib} GiB disk is larger than the largest Premium SSD tier (P80, 32767 GiB)")


# --- the price of a node-hour, for a run's record -------------------------------------------------
@dataclass(frozen=True)
class Price:
    """USD per node-hour of one VM size in one region, with where the figure comes from."""

    usd_per_hour: Decimal
    as_of: date  # the price table's date
    source: str
    estimate: str | None = None

    def cost_of(self, node_hours: Decimal | float) -> Decimal:
        return (self.usd_per_hour * Decimal(str(node_hours))).quantize(QUANTUM, ROUND_HALF_UP)


def node_hour_price(sku: str, region: str, prices: Path = PRICES_FILE, spot: bool = False) -> Price | None:
    """The price of one node-hour of `sku` in `region` (on demand, or Spot), or None where the table has
    none. A missing or broken table file raises OperatorError."""
    table = load_price_table(prices)
    quote = table.lookup("vm_spot_hourly" if spot else "vm_hourly", sku, region)
    if quote is None:
        return None
    return Price(quote.usd, table.as_of, table.describe_source(quote.source), quote.estimate)


# --- the stack file ------------------------------------------------------------------------------
def pulumi_project() -> str:
    """The project name, which prefixes every key of a stack file (`<project>:nodeCount`)."""
    document = _yaml(REPO_ROOT / "Pulumi.yaml", "Pulumi project file")
    name = document.get("name") if isinstance(document, dict) else None
    if not isinstance(name, str) or not name:
        raise OperatorError(f"{REPO_ROOT / 'Pulumi.yaml'} has no project `name`")
    return name


def read_stack_config(path: Path) -> StackConfig:
    """A Pulumi.<stack>.yaml, validated like `pulumi up` validates it (infra.config)."""
    document = _yaml(path, "stack file")
    config = document.get("config") if isinstance(document, dict) else None
    if not isinstance(config, dict):
        raise OperatorError(f"stack file {path} has no `config:` mapping: pass a Pulumi.<stack>.yaml")
    project = pulumi_project()
    prefix = f"{project}:"
    raw = {str(key).removeprefix(prefix): value for key, value in config.items() if str(key).startswith(prefix)}
    if not raw:
        raise OperatorError(f"stack file {path} sets no `{project}:` keys: is it a stack file of this project?")
    try:
        return parse_config(raw, project)
    except ConfigError as exc:
        raise OperatorError(f"stack file {path}: {exc}") from None


def _yaml(path: Path, what: str) -> Any:
    try:
        return yaml.safe_load(read_text_file(path, what))
    except yaml.YAMLError as exc:
        raise OperatorError(f"{what} {path} is not YAML ({' '.join(str(exc).split())})") from None


# --- the estimate --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostRow:
    item: str
    size: str
    count: int
    basis: str  # the unit price as the table gives it, e.g. "$122.88/month / 730 h"
    usd_per_hour: Decimal  # count x unit price per hour, rounded once to QUANTUM
    quote: Quote | None = None


@dataclass(frozen=True)
class CostEstimate:
    region: str
    rows: tuple[CostRow, ...]
    table: PriceTable

    @property
    def total(self) -> Decimal:
        return sum((row.usd_per_hour for row in self.rows), Decimal(0))

    @property
    def sources(self) -> list[str]:
        """The price table's sources behind the rows, in the rows' order."""
        return list(dict.fromkeys(row.quote.source for row in self.rows if row.quote))


@dataclass(frozen=True)
class LiveNodes:
    """The GPU nodes as the cluster's Slurm holds them now (`cost --live`), per scale set."""

    running: int
    unregistered: int  # deallocated by the head node's reaper: never registered with Slurm
    spot_running: int
    spot_unregistered: int


def count_nodes(cfg: StackConfig, nodes: Sequence[NodeInfo]) -> LiveNodes:
    """Slurm's nodes counted by scale set (by the computer name prefix each carries) and power state."""
    counts = {kind: [0, 0] for kind in ("gpu", "spot")}
    for node in nodes:
        kind = next((k for k in counts if node.name.startswith(f"{cfg.name_prefix}-{k}-")), None)
        if kind is not None:
            counts[kind][0] += not node.powered_down
            counts[kind][1] += node.unregistered
    return LiveNodes(*counts["gpu"], *counts["spot"])


def read_live_nodes(cluster: str | None) -> list[NodeInfo]:
    desc = load(cluster)
    with SSH(desc) as ssh:
        return Slurm(desc, ssh).nodes()


def running_nodes(cfg: StackConfig, requested: int | None) -> int:
    if requested is None:
        return cfg.node_count
    if requested > cfg.node_count:
        raise OperatorError(f"--running-nodes {requested} is more than the stack's nodeCount {cfg.node_count}")
    return requested


def estimate_cost(
    cfg: StackConfig, table: PriceTable, requested_nodes: int | None = None, live: LiveNodes | None = None
) -> CostEstimate:
    """Rows of what the stack costs per hour in its region, with `requested_nodes` GPU nodes up, or with
    the nodes as Slurm holds them (live)."""
    region = cfg.location
    running = live.running if live else running_nodes(cfg, requested_nodes)
    unregistered = live.unregistered if live else 0
    gpu = table.require("vm_hourly", cfg.gpu_sku, region)

    def vm(item: str, size: str) -> CostRow:
        return _row(item, size, 1, table.require("vm_hourly", size, region), Decimal(1), "h")

    shared = _lustre_rows(cfg, table) if cfg.shared_storage == "lustre" else _nfs_rows(cfg, table, vm)
    rows = (
        _row("GPU nodes, running", cfg.gpu_sku, running, gpu, Decimal(1), "h"),
        CostRow(
            "GPU nodes, power-saved", cfg.gpu_sku, cfg.node_count - running - unregistered, "$0 (deallocated)", ZERO
        ),
        *_unregistered_rows(cfg, live),
        *_spot_rows(cfg, table, gpu, live.spot_running if live else cfg.spot_node_count),
        vm("head node (slurmctld)", cfg.head_vm_size),
        *shared,
        vm("jumpbox", cfg.jumpbox_vm_size),
        _row(
            "container registry",
            f"ACR {REGISTRY_SKU}",
            1,
            table.require("registry_daily", REGISTRY_SKU, region),
            HOURS_PER_DAY,
            "day",
        ),
    )
    return CostEstimate(region, rows, table)


def _nfs_rows(cfg: StackConfig, table: PriceTable, vm: Callable[[str, str], CostRow]) -> list[CostRow]:
    """The NFS server, and its data disks at the Premium SSD tier that holds their size."""
    tier = premium_ssd_tier(cfg.nfs_disk_size_gb)
    disks = table.require("premium_ssd_monthly", tier, cfg.location)
    return [
        vm("NFS server", cfg.nfs_vm_size),
        _row(
            "NFS data disks",
            f"Premium SSD {tier} ({cfg.nfs_disk_size_gb} GiB)",
            cfg.nfs_disk_count,
            disks,
            HOURS_PER_MONTH,
            "month",
        ),
    ]


def _lustre_rows(cfg: StackConfig, table: PriceTable) -> list[CostRow]:
    """Azure Managed Lustre: its capacity times its tier's price per TiB-hour, which bills while the stack
    stands (it has no stopped state)."""
    sku, capacity = cfg.lustre_sku, cfg.lustre_capacity_tib
    assert capacity is not None  # infra.config requires it with sharedStorage lustre
    quote = table.lookup("lustre_tib_hourly", sku.name, cfg.location)
    if quote is None:
        raise OperatorError(
            f"{table.origin} has no price for Azure Managed Lustre {sku.name} in {cfg.location} (--refresh reads "
            f"none either): add its USD per TiB-hour, from {LUSTRE_PRICES_URL}, under lustre_tib_hourly in a copy of "
            'the table and pass it with --prices FILE (docs/operator.md, "Cost")'
        )
    return [_row("Azure Managed Lustre", f"{sku.name} ({capacity} TiB)", capacity, quote, Decimal(1), "TiB-hour")]


def _unregistered_rows(cfg: StackConfig, live: LiveNodes | None) -> list[CostRow]:
    """The nodes the head node deallocated because they never registered: $0, and worth a look in `status`."""
    count = live.unregistered + live.spot_unregistered if live else 0
    basis = "$0 (deallocated; `status` says why)"
    return [CostRow("GPU nodes, never registered", cfg.gpu_sku, count, basis, ZERO)] if count else []


def _spot_rows(cfg: StackConfig, table: PriceTable, on_demand: Quote, running: int) -> list[CostRow]:
    """The running Spot nodes (by default all spotNodeCount) at the table's Spot price; where it has none,
    at the on-demand price, which a Spot VM never exceeds (its max price is at most that, or -1: up to it)."""
    if not cfg.spot_node_count:
        return []
    quote = table.lookup("vm_spot_hourly", cfg.gpu_sku, cfg.location)
    if quote is None:
        row = _row("Spot GPU nodes, running", cfg.gpu_sku, running, on_demand, Decimal(1), "h")
        return [dataclasses.replace(row, basis=f"at most ${on_demand.usd}/h (no Spot price in the table)")]
    return [_row("Spot GPU nodes, running", cfg.gpu_sku, running, quote, Decimal(1), "h")]


def _row(item: str, size: str, count: int, quote: Quote, hours: Decimal, unit: str) -> CostRow:
    basis = f"${quote.usd}/{unit}" + (f" / {hours} h" if hours != 1 else "")
    usd_per_hour = (count * quote.usd / hours).quantize(QUANTUM, ROUND_HALF_UP)
    return CostRow(item, size, count, basis, usd_per_hour, quote)


# --- --refresh: the Azure Retail Prices API -------------------------------------------------------
@dataclass(frozen=True)
class _Meter:
    """How one section's prices appear in the API: which items, named by which field."""

    section: Section
    service: str
    unit: str  # unitOfMeasure
    field: str  # the item field that names the size, tier or SKU
    meter_format: str  # table name -> that field's value
    product: str | None = None


METERS = (
    _Meter("vm_hourly", "Virtual Machines", "1 Hour", "armSkuName", "{}"),
    _Meter("premium_ssd_monthly", "Storage", "1/Month", "meterName", "{} LRS Disk", "Premium SSD Managed Disks"),
    _Meter("registry_daily", "Container Registry", "1/Day", "meterName", "{} Registry Unit"),
)


def retail_prices_url() -> str:
    return os.environ.get(RETAIL_PRICES_URL_ENV) or RETAIL_PRICES_URL


def refresh_prices(regions: Sequence[str], wanted: dict[Section, Sequence[str]]) -> PriceTable:
    """Read live prices of the wanted names (per section) in each region; absent ones are left out."""
    base = retail_prices_url()
    found: dict[Section, dict[str, dict[str, Quote]]] = {meter.section: {} for meter in METERS}
    for region in regions:
        for meter in METERS:
            if names := wanted.get(meter.section):
                for name, quote in _fetch_section(base, meter, region, names).items():
                    found[meter.section].setdefault(name, {})[region] = quote
    today = datetime.now(UTC).date()
    api = Source(what="Azure Retail Prices API (live)", url=base, taken=today)
    table = PriceTable(
        as_of=today,
        source=f"Azure Retail Prices API ({base}), read live",
        query="$filter=serviceName eq '<service>' and priceType eq 'Consumption' and armRegionName eq '<region>' "
        "and (armSkuName or meterName) eq '<size, tier or SKU>'",
        currency="USD",
        price_type=PRICE_TYPE,
        sources={"retail-prices-api": api},
        **found,
    )
    table._origin = f"live prices from {base} ({today})"
    return table


def _fetch_section(base: str, meter: _Meter, region: str, names: Sequence[str]) -> dict[str, Quote]:
    wanted = {meter.meter_format.format(name): name for name in names}
    clauses = " or ".join(f"{meter.field} eq '{value}'" for value in wanted)
    odata = f"serviceName eq '{meter.service}' and priceType eq 'Consumption' and armRegionName eq '{region}'"
    odata += (f" and productName eq '{meter.product}'" if meter.product else "") + f" and ({clauses})"
    best: dict[str, dict[str, Any]] = {}
    for item in fetch_items(base, odata):
        name = wanted.get(str(item.get(meter.field, "")))
        # Of several list prices for one name (a repriced meter), the latest effectiveStartDate holds.
        latest = str(item.get("effectiveStartDate", "")) >= str(best.get(name or "", {}).get("effectiveStartDate", ""))
        if name and latest and item.get("armRegionName") == region and _is_list_price(item, meter):
            best[name] = item
    return {name: Quote(usd=item["retailPrice"], source="retail-prices-api") for name, item in best.items()}


def _is_list_price(item: dict[str, Any], meter: _Meter) -> bool:
    """Pay-as-you-go Linux in USD: not Spot or Low Priority (named in skuName and meterName), not
    a Windows product, not a reservation or dev/test rate, and in the section's unit."""
    names = f"{item.get('skuName', '')} {item.get('meterName', '')}"
    product = item.get("productName", "")
    return (
        item.get("type") == "Consumption"
        and item.get("unitOfMeasure") == meter.unit
        and item.get("currencyCode", "USD") == "USD"
        and "Spot" not in names
        and "Low Priority" not in names
        and "Windows" not in product
        and (meter.product is None or product == meter.product)
        and type(item.get("retailPrice")) in (int, Decimal)  # a number (JSON floats parsed as Decimal)
    )


def fetch_items(base: str, odata_filter: str, timeout: float = 30) -> list[dict[str, Any]]:
    """Every item the API returns for a $filter, following NextPageLink."""
    url: str | None = f"{base}?$filter={urllib.parse.quote(odata_filter)}"
    items: list[dict[str, Any]] = []
    for _ in range(MAX_PAGES):
        if not url:
            return items
        page = _get_page(url, base, timeout)
        items += [item for item in page["Items"] if isinstance(item, dict)]
        url = page.get("NextPageLink")
    raise OperatorError(f"the Azure Retail Prices API at {base} kept paging past {MAX_PAGES} pages", ExitCode.NOT_READY)


def _get_page(url: str, base: str, timeout: float) -> dict[str, Any]:
    failed = f"cannot read prices from the Azure Retail Prices API at {base}"
    fallback = f"run without --refresh to use the shipped price table ({shown_path(PRICES_FILE)})"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            page = json.loads(response.read(), parse_float=Decimal)  # exact prices, never binary floats
    except urllib.error.HTTPError as exc:
        reason = f"HTTP {exc.code} {exc.reason}"
    except (OSError, http.client.HTTPException) as exc:
        reason = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
    except ValueError:
        reason = "the answer is not JSON"
    else:
        if isinstance(page, dict) and isinstance(page.get("Items"), list):
            return page
        reason = "the answer is not a price list (no Items)"
    raise OperatorError(f"{failed}: {reason}; {fallback}", ExitCode.NOT_READY)


def wanted_prices(cfg: StackConfig, full_table: bool) -> tuple[list[str], dict[Section, list[str]]]:
    """Regions and names to refresh: this stack's, or everything the shipped table covers."""
    sizes = [cfg.gpu_sku, cfg.head_vm_size, cfg.nfs_vm_size, cfg.jumpbox_vm_size]
    if not full_table:
        tiers = [premium_ssd_tier(cfg.nfs_disk_size_gb)]
        return [cfg.location], {"vm_hourly": sizes, "premium_ssd_monthly": tiers, "registry_daily": [REGISTRY_SKU]}
    defaults = [str(StackConfig.model_fields[f"{role}_vm_size"].default) for role in ("jumpbox", "head", "nfs")]
    return list(dict.fromkeys([*COMMON_REGIONS, cfg.location])), {
        "vm_hourly": list(dict.fromkeys([*GPU_SKUS, *defaults, *sizes])),
        "premium_ssd_monthly": [tier for tier, _ in PREMIUM_SSD_TIERS],
        "registry_daily": [REGISTRY_SKU],
    }


def shown_path(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
