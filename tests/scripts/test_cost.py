"""`python -m dtrain cost`: the stack's hourly cost from its stack file and the shipped price table,
or live from the Azure Retail Prices API (`--refresh`), and `node_hour_price` for a run's record.

The command runs as the CLI runs it (dtrain.__main__.main, output captured). Expected amounts are
computed here from infra/data/prices.json and the stack file, never copied from the command's output.
`--refresh` talks to a real HTTP server on 127.0.0.1 that answers with the responses under
fixtures/retail_prices/. They are hand-built in the API's response shape (no capture of the live API
could be taken where these tests were written): items and field names as the API returns them, with
the Windows, Spot, Low Priority and reservation items that must be passed over.
"""

from __future__ import annotations

import http.server
import json
import re
import urllib.parse
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import yaml

from dtrain import idle_cost, pricing
from dtrain.__main__ import main
from dtrain.errors import ExitCode
from dtrain.local.daemons import free_port
from infra.config import StackConfig, parse_config
from tests.local_http import serving

from .conftest import FIXTURES, REPO

DEV_STACK = REPO / "Pulumi.dev.yaml"
PROJECT = yaml.safe_load((REPO / "Pulumi.yaml").read_text())["name"]
TABLE = json.loads(pricing.PRICES_FILE.read_text(), parse_float=Decimal)
RECORDED = FIXTURES / "retail_prices"
RECORDED_BASE = "https://prices.azure.com:443/api/retail/prices"
CENTS = Decimal("0.0001")


def dev_config() -> StackConfig:
    stack = yaml.safe_load(DEV_STACK.read_text())["config"]
    return parse_config({key.removeprefix(f"{PROJECT}:"): value for key, value in stack.items()}, PROJECT)


def per_hour(amount: Decimal, hours: int = 1) -> Decimal:
    return (amount / hours).quantize(CENTS, ROUND_HALF_UP)


def expected_rows(cfg: StackConfig, running: int) -> dict[str, Decimal]:
    """Each row's USD per hour, from the shipped table's own numbers."""
    vm, region = TABLE["vm_hourly"], cfg.location
    tier = next(tier for tier, capacity in pricing.PREMIUM_SSD_TIERS if cfg.nfs_disk_size_gb <= capacity)
    return {
        "GPU nodes, running": per_hour(running * vm[cfg.gpu_sku][region]["usd"]),
        "GPU nodes, power-saved": Decimal(0),
        "head node (slurmctld)": per_hour(vm[cfg.head_vm_size][region]["usd"]),
        "NFS server": per_hour(vm[cfg.nfs_vm_size][region]["usd"]),
        "NFS data disks": per_hour(cfg.nfs_disk_count * TABLE["premium_ssd_monthly"][tier][region]["usd"], 730),
        "jumpbox": per_hour(vm[cfg.jumpbox_vm_size][region]["usd"]),
        "container registry": per_hour(TABLE["registry_daily"]["Standard"][region]["usd"], 24),
    }


def run_cost(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(["cost", *args])
    except SystemExit as usage_error:  # argparse exits on a usage error, as it does for the real CLI
        code = int(usage_error.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def json_rows(out: str) -> tuple[dict[str, Decimal], Decimal, dict[str, Any]]:
    document = json.loads(out)
    rows = {row["item"]: Decimal(row["usd_per_hour"]) for row in document["rows"]}
    return rows, Decimal(document["total_usd_per_hour"]), document


def stack_file(tmp_path: Path, **changes: str) -> Path:
    """Pulumi.dev.yaml with some keys changed (a value of "" removes the key)."""
    document = yaml.safe_load(DEV_STACK.read_text())
    for key, value in changes.items():
        document["config"].pop(f"{PROJECT}:{key}", None)
        if value:
            document["config"][f"{PROJECT}:{key}"] = value
    path = tmp_path / "Pulumi.test.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


# --- the table for Pulumi.dev.yaml -------------------------------------------------------------
def test_dev_stack_rows_are_the_shipped_prices_and_the_total_is_their_sum(capsys):
    code, out, err = run_cost(capsys, "--json")
    assert code == 0, err
    rows, total, document = json_rows(out)
    cfg = dev_config()
    assert rows == expected_rows(cfg, running=cfg.node_count)
    assert total == sum(rows.values())
    assert document["region"] == cfg.location == "eastus"
    assert document["prices"]["as_of"] == TABLE["as_of"] and document["prices"]["source"] == TABLE["source"]


def test_dev_stack_table_prints_rows_that_add_up_with_the_tables_date_and_source(capsys):
    code, out, err = run_cost(capsys)
    assert code == 0, err
    amounts = [Decimal(a.replace(",", "")) for a in re.findall(r"\$([\d,]+\.\d{4})\s*│\s*$", out, re.MULTILINE)]
    *rows, total = amounts
    cfg = dev_config()
    assert rows == list(expected_rows(cfg, running=cfg.node_count).values())
    assert total == sum(rows)
    assert f"as of {TABLE['as_of']}" in out and TABLE["source"] in " ".join(out.split())
    words = " ".join(out.split())  # rich wraps long lines at the console's width, which varies by runner
    assert "Not included:" in words and "blob storage and egress" in words
    # the eastus disk and registry figures are flagged as estimates in the table, and so in the output
    assert "estimated: NFS data disks" in out and "estimated: container registry" in out


@pytest.mark.parametrize("running", [1, 0])
def test_running_nodes_lowers_the_gpu_row_and_power_saved_nodes_cost_nothing(capsys, running):
    code, out, err = run_cost(capsys, "--json", "--running-nodes", str(running))
    assert code == 0, err
    rows, total, document = json_rows(out)
    cfg = dev_config()
    assert rows == expected_rows(cfg, running=running)
    saved = next(row for row in document["rows"] if row["item"] == "GPU nodes, power-saved")
    assert saved["count"] == cfg.node_count - running and Decimal(saved["usd_per_hour"]) == 0
    full = sum(expected_rows(cfg, running=cfg.node_count).values())
    node = TABLE["vm_hourly"][cfg.gpu_sku][cfg.location]["usd"]
    assert total == sum(rows.values()) == full - (cfg.node_count - running) * node


def test_the_readme_quotes_what_cost_prints_for_the_dev_stack(capsys):
    """README's first screen gives the default stack's hourly and idle cost as this command prints them:
    a new price table, or a changed Pulumi.dev.yaml, must change the README too."""
    code, out, err = run_cost(capsys, "--json")
    assert code == 0, err
    rows, total, document = json_rows(out)
    idle, cents = document["idle"], Decimal("0.01")
    gpu_nodes, node = rows["GPU nodes, running"], Decimal(idle["gpu_node_usd_per_hour"])
    standing, tail = Decimal(idle["standing_usd_per_hour"]).quantize(cents), idle["until_autostop_usd"]
    section = (REPO / "README.md").read_text().split("## What it costs", 1)[1].split("\n## ", 1)[0]
    quoted = {
        "the price table's date": f"({document['prices']['as_of']})",
        "the total": f"**${total.quantize(cents)}** (GPU nodes ${gpu_nodes.quantize(cents)}",
        "the rest": f"everything else ${standing})",
        "idle": f"**${standing}** (head node",
        "until autostop": f"({idle['autostop_minutes']} idle minutes) deallocates the nodes | ${tail}",
        "per GPU": f"${(node / 8).quantize(cents)} per GPU-hour (${node} per node-hour / 8)",
    }
    missing = {what: text for what, text in quoted.items() if text not in section}
    assert not missing, f"README.md's cost no longer matches `dtrain cost`: {missing}"


# --- the idle cost: what the standing cluster bills with no job running ----------------------------
@pytest.mark.parametrize(("running", "autostop"), [(2, "30"), (0, "30"), (1, "0")])
def test_idle_cost_is_every_row_but_the_gpu_nodes_plus_the_nodes_on_until_autostop(capsys, tmp_path, running, autostop):
    path = stack_file(tmp_path, autostopMinutes=autostop)
    code, out, err = run_cost(capsys, "--json", "--stack-file", str(path), "--running-nodes", str(running))
    assert code == 0, err
    _, total, document = json_rows(out)
    cfg = dev_config()
    node = TABLE["vm_hourly"][cfg.gpu_sku][cfg.location]["usd"]
    idle = document["idle"]
    assert Decimal(idle["standing_usd_per_hour"]) == total - running * node > 0  # head, NFS, jumpbox, registry
    assert Decimal(idle["usd_per_hour"]) == total and Decimal(idle["gpu_node_usd_per_hour"]) == node
    assert (idle["gpu_nodes_on"], idle["autostop_minutes"]) == (running, int(autostop))
    tail = None if autostop == "0" else str(per_hour(running * node * int(autostop) / 60).quantize(Decimal("0.01")))
    assert idle["until_autostop_usd"] == tail
    code, out, err = run_cost(capsys, "--stack-file", str(path), "--running-nodes", str(running))
    text = " ".join(out.split())
    assert code == 0 and f"idle cost: ${total:,.2f}/hour" in text
    assert ("autostop is off" in text) == (autostop == "0" and running > 0)
    # a job's share, as launch quotes it: the node price over the node's GPUs
    assert f"/ 8 GPUs = ${node / 8:,.4f}/GPU-hour" in text


# --- a stack with Azure Managed Lustre in place of the NFS server -----------------------------------
LUSTRE_STACK = {
    "sharedStorage": "lustre",
    "lustreCapacityTib": "32",
    "nfsVmSize": "",
    "nfsDiskCount": "",
    "nfsDiskSizeGb": "",
}
# A stand-in figure for the test's own price file, not Azure's price: the shipped table carries none for Lustre.
TEST_TIB_HOUR = Decimal("0.25")


def test_lustre_is_priced_by_capacity_and_tier_in_place_of_the_nfs_server(capsys, tmp_path):
    table = json.loads(pricing.PRICES_FILE.read_text())
    table["sources"]["test-figure"] = {"what": "a figure made up for this test"}
    table["lustre_tib_hourly"] = {
        "AMLFS-Durable-Premium-125": {"eastus": {"usd": float(TEST_TIB_HOUR), "source": "test-figure"}}
    }
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(table))
    path = stack_file(tmp_path, **LUSTRE_STACK)
    code, out, err = run_cost(capsys, "--json", "--stack-file", str(path), "--prices", str(prices))
    assert code == 0, err
    rows, total, document = json_rows(out)
    nfs = expected_rows(dev_config(), running=2)
    assert "NFS server" not in rows and "NFS data disks" not in rows
    assert rows["Azure Managed Lustre"] == 32 * TEST_TIB_HOUR  # 32 TiB of the 125 MB/s tier
    lustre_row = next(row for row in document["rows"] if row["item"] == "Azure Managed Lustre")
    assert lustre_row["size"] == "AMLFS-Durable-Premium-125 (32 TiB)" and lustre_row["basis"] == "$0.25/TiB-hour"
    assert total == sum(nfs.values()) - nfs["NFS server"] - nfs["NFS data disks"] + 32 * TEST_TIB_HOUR
    # it bills with the head node while the stack stands: part of the idle cost
    standing = total - 2 * TABLE["vm_hourly"][dev_config().gpu_sku]["eastus"]["usd"]
    code, out, _ = run_cost(capsys, "--stack-file", str(path), "--prices", str(prices), "--running-nodes", "0")
    words = " ".join(out.split())
    assert code == 0 and f"${standing:,.2f}/hour for the head node, Lustre, jumpbox and registry" in words


def test_a_lustre_stack_without_a_price_for_its_tier_says_where_to_put_one(capsys, tmp_path):
    code, _, err = run_cost(capsys, "--stack-file", str(stack_file(tmp_path, **LUSTRE_STACK)))
    assert code == ExitCode.BAD_INPUT
    assert "has no price for Azure Managed Lustre AMLFS-Durable-Premium-125 in eastus" in err
    assert "under lustre_tib_hourly in a copy of the table and pass it with --prices FILE" in err


def test_status_states_the_idle_cost_of_the_cluster_from_its_stack_file_where_it_is_at_hand():
    cfg = dev_config()
    node = TABLE["vm_hourly"][cfg.gpu_sku][cfg.location]["usd"]
    azure = {"provider": "azure", "gpu_sku": cfg.gpu_sku, "region": cfg.location}
    dev = idle_cost.for_cluster(SimpleNamespace(name="dev", **azure), nodes_on=1)  # type: ignore[arg-type]
    standing = sum(expected_rows(cfg, running=0).values())
    assert (dev.standing_usd_per_hour, dev.per_hour) == (standing, standing + node)
    assert f"idle cost: ${standing + node:,.2f}/hour" in dev.describe() and "until they stop after 30" in dev.describe()
    # no stack file for it here: the GPU nodes' part alone, and where to get the rest
    other = idle_cost.for_cluster(SimpleNamespace(name="elsewhere", **azure), nodes_on=2)  # type: ignore[arg-type]
    assert other.per_hour is None and other.describe().startswith(f"idle cost: ${2 * node:,.2f}/hour for 2 GPU nodes")
    assert "`dtrain cost --stack-file` prices them" in other.describe()
    local = idle_cost.for_cluster(SimpleNamespace(provider="local", name="hvd"), nodes_on=2)  # type: ignore[arg-type]
    assert local.describe() == "idle cost: $0 (local cluster: no charge)"


# --- bad input: a clear error and exit status 2, before anything is fetched ---------------------
def test_a_missing_stack_file_is_named(capsys, tmp_path):
    missing = tmp_path / "Pulumi.nope.yaml"
    code, out, err = run_cost(capsys, "--stack-file", str(missing))
    assert code == ExitCode.BAD_INPUT and out == ""
    assert err == f"error: cannot read the stack file {missing}: it does not exist (check the path)\n"


def test_an_invalid_stack_config_gets_the_same_errors_as_pulumi_up(capsys, tmp_path):
    code, _, err = run_cost(capsys, "--stack-file", str(stack_file(tmp_path, nodeCount="500", gpuSku="")))
    assert code == ExitCode.BAD_INPUT
    assert "invalid stack configuration:" in err
    assert f"{PROJECT}:nodeCount: got '500'; Input should be less than or equal to 100" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("config: [unclosed\n", "is not YAML"),
        ("just text\n", "has no `config:` mapping"),
        ("config:\n  other-project:location: eastus\n", f"sets no `{PROJECT}:` keys"),
    ],
    ids=["not-yaml", "no-config", "other-project"],
)
def test_a_file_that_is_not_a_stack_file_is_refused(capsys, tmp_path, text, message):
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text(text)
    code, _, err = run_cost(capsys, "--stack-file", str(path))
    assert code == ExitCode.BAD_INPUT and message in err and err.startswith(f"error: stack file {path}")


def test_a_region_the_table_lacks_names_the_regions_it_has_and_suggests_refresh(capsys, tmp_path):
    code, _, err = run_cost(capsys, "--stack-file", str(stack_file(tmp_path, location="swedencentral")))
    assert code == ExitCode.BAD_INPUT
    regions = ", ".join(sorted(TABLE["vm_hourly"]["Standard_ND96isr_H100_v5"]))
    assert (
        f"has no price for VM size Standard_ND96isr_H100_v5 in swedencentral (it has Standard_ND96isr_H100_v5 in "
        f"{regions}); run with --refresh" in err
    )


def test_a_disk_tier_the_table_lacks_is_named(capsys, tmp_path):
    code, _, err = run_cost(capsys, "--stack-file", str(stack_file(tmp_path, nfsDiskSizeGb="512")))
    assert code == ExitCode.BAD_INPUT and "no price for Premium SSD tier P20 in eastus" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--running-nodes", "3"), "error: --running-nodes 3 is more than the stack's nodeCount 2\n"),
        (("--running-nodes", "-1"), "argument --running-nodes: must be a whole number >= 0, got '-1'"),
        (("--save", "x.json"), "error: --save and --full-table go with --refresh"),
        (("--prices", "p.json", "--refresh"), "argument --refresh: not allowed with argument --prices"),
        (("--live", "--running-nodes", "1"), "argument --running-nodes: not allowed with argument --live"),
        (("--live", "--cluster", "/nonexistent/cluster.json"), "error: no cluster description at /nonexistent/"),
        (("--by", "user", "--since", "garbage"), "--since: 'garbage' is not a date: give YYYY-MM-DD or"),
        (("--by", "user", "--since", "2999-01-01"), "--since: 2999-01-01 is in the future: nothing has run since"),
        (("--by", "team"), "argument --by: invalid choice: 'team' (choose from 'user', 'account')"),
        (("--since", "2026-01-01"), "error: --since goes with --by (the jobs since a date)\n"),
        (("--by", "user", "--live"), "error: --live goes without --by (it prices the stack file, not the jobs)\n"),
        (("--by", "user", "--cluster", "/nonexistent/cluster.json"), "error: no cluster description at /nonexist"),
    ],
    ids=[
        "above-node-count",
        "negative",
        "save-without-refresh",
        "prices-and-refresh",
        "live-and-count",
        "live-no-desc",
        "since-garbage",
        "since-future",
        "by-what",
        "since-without-by",
        "by-and-live",
        "by-no-desc",
    ],
)
def test_bad_flags_are_refused(capsys, args, message):
    code, out, err = run_cost(capsys, *args)
    assert code == ExitCode.BAD_INPUT and out == "" and message in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "is not JSON"),
        (json.dumps({**json.loads(pricing.PRICES_FILE.read_text()), "currency": "EUR"}), "currency"),
        (
            json.dumps({**json.loads(pricing.PRICES_FILE.read_text()), "sources": {}}),
            "quotes name sources not listed under `sources`",
        ),
    ],
    ids=["not-json", "not-usd", "unknown-source"],
)
def test_a_broken_price_table_is_refused(capsys, tmp_path, content, message):
    prices = tmp_path / "prices.json"
    prices.write_text(content)
    code, _, err = run_cost(capsys, "--prices", str(prices))
    assert code == ExitCode.BAD_INPUT and f"price table {prices}" in err and message in err


# --- --refresh against a local server answering with the recorded responses ----------------------
class RetailPrices(http.server.BaseHTTPRequestHandler):
    """Answers $filter queries like the API: by serviceName, a second page for $skip. /broken fails."""

    requests: ClassVar[list[dict[str, list[str]]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        type(self).requests.append(query)
        if url.path == "/broken":
            self._answer(500, "text/plain", "internal error")
            return
        service = re.search(r"serviceName eq '([^']+)'", query["$filter"][0]).group(1)
        name = {"Virtual Machines": "vms_page1", "Storage": "disks", "Container Registry": "registry"}[service]
        body = (RECORDED / f"{'vms_page2' if '$skip' in query else name}.json").read_text()
        base = f"http://127.0.0.1:{self.server.server_address[1]}/api/retail/prices"
        self._answer(200, "application/json", body.replace(RECORDED_BASE, base))

    def _answer(self, status: int, kind: str, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The base URL of a local Retail Prices API, which the command reads through the environment."""
    RetailPrices.requests.clear()
    monkeypatch.setenv("no_proxy", "*")  # never through a proxy: the server is on loopback
    with serving(RetailPrices) as server:
        base = f"{server}/api/retail/prices"
        monkeypatch.setenv(pricing.RETAIL_PRICES_URL_ENV, base)
        yield base


def test_refresh_reads_every_page_and_only_linux_pay_as_you_go_prices(capsys, api):
    code, out, err = run_cost(capsys, "--refresh", "--json")
    assert code == 0, err
    rows, total, document = json_rows(out)
    cfg = dev_config()
    # The recorded Linux prices: not the Windows, Spot, Low Priority or reservation items beside them.
    # D4s_v5 and B2s are only on the second page.
    assert rows == {
        "GPU nodes, running": Decimal("196.6400"),
        "GPU nodes, power-saved": Decimal(0),
        "head node (slurmctld)": Decimal("0.1920"),
        "NFS server": Decimal("0.7680"),
        "NFS data disks": per_hour(4 * Decimal("122.88"), 730),
        "jumpbox": Decimal("0.0416"),
        "container registry": per_hour(Decimal("0.667"), 24),
    }
    assert total == sum(rows.values())
    assert document["prices"]["table"].startswith(f"live prices from {api}")
    assert all(row["estimate"] is None for row in document["rows"])
    filters = [query["$filter"][0] for query in RetailPrices.requests]
    assert len(filters) == 4 and "$skip" in RetailPrices.requests[1]  # VMs (2 pages), disks, registry
    assert all("armRegionName eq 'eastus'" in f and "priceType eq 'Consumption'" in f for f in filters)
    sizes = set(re.findall(r"armSkuName eq '([^']+)'", filters[0]))
    assert sizes == {cfg.gpu_sku, cfg.head_vm_size, cfg.nfs_vm_size, cfg.jumpbox_vm_size}
    assert "meterName eq 'P30 LRS Disk'" in filters[2] and "meterName eq 'Standard Registry Unit'" in filters[3]


def test_refresh_saves_what_it_read_for_a_later_run_without_network(capsys, api, tmp_path):
    saved = tmp_path / "cache" / "prices.json"
    code, live, err = run_cost(capsys, "--refresh", "--save", str(saved), "--json")
    assert code == 0 and f"wrote {saved}" in err
    table = pricing.load_price_table(saved)
    assert set(table.sources) == {"retail-prices-api"} and table.sources["retail-prices-api"].url == api
    assert table.vm_hourly["Standard_ND96isr_H100_v5"] == {
        "eastus": pricing.Quote(usd=Decimal("98.32"), source="retail-prices-api")
    }
    RetailPrices.requests.clear()
    code, offline, err = run_cost(capsys, "--prices", str(saved), "--json")
    assert code == 0, err
    assert RetailPrices.requests == [] and json_rows(offline)[:2] == json_rows(live)[:2]


def test_refresh_full_table_asks_for_every_size_tier_and_common_region(capsys, api, tmp_path):
    saved = tmp_path / "prices.json"
    code, _, err = run_cost(capsys, "--refresh", "--full-table", "--save", str(saved))
    assert code == 0, err
    filters = [query["$filter"][0] for query in RetailPrices.requests]
    regions = {re.search(r"armRegionName eq '([^']+)'", f).group(1) for f in filters}
    assert regions == set(pricing.COMMON_REGIONS)
    vm_filter = next(f for f in filters if "Virtual Machines" in f)
    assert set(re.findall(r"armSkuName eq '([^']+)'", vm_filter)) == {
        *pricing.GPU_SKUS,
        *(str(StackConfig.model_fields[f"{role}_vm_size"].default) for role in ("jumpbox", "head", "nfs")),
    }
    disk_filter = next(f for f in filters if "Storage" in f)
    assert re.findall(r"meterName eq '(P\d+) LRS Disk'", disk_filter) == [t for t, _ in pricing.PREMIUM_SSD_TIERS]
    # The recorded answers are eastus items, so only eastus prices are kept, whatever region was asked.
    table = pricing.load_price_table(saved)
    assert {region for regions in table.vm_hourly.values() for region in regions} == {"eastus"}


def test_bad_input_is_refused_before_any_request(capsys, api):
    code, _, err = run_cost(capsys, "--refresh", "--running-nodes", "9")
    assert code == ExitCode.BAD_INPUT and "more than the stack's nodeCount" in err
    assert RetailPrices.requests == []


def test_refresh_without_the_api_says_to_use_the_shipped_table_and_exits_3(capsys, monkeypatch):
    monkeypatch.setenv(pricing.RETAIL_PRICES_URL_ENV, f"http://127.0.0.1:{free_port()}/api/retail/prices")
    monkeypatch.setenv("no_proxy", "*")
    code, out, err = run_cost(capsys, "--refresh")
    assert code == ExitCode.NOT_READY and out == ""
    assert err.startswith("error: cannot read prices from the Azure Retail Prices API at http://127.0.0.1:")
    assert "refused" in err and "run without --refresh to use the shipped price table (infra/data/prices.json)" in err


def test_refresh_with_a_failing_api_exits_3(capsys, api, monkeypatch):
    monkeypatch.setenv(pricing.RETAIL_PRICES_URL_ENV, api.replace("/api/retail/prices", "/broken"))
    code, _, err = run_cost(capsys, "--refresh")
    assert code == ExitCode.NOT_READY and "HTTP 500" in err and "run without --refresh" in err


# --- the pieces the launcher and the table use ----------------------------------------------------
def test_node_hour_price_is_the_tables_price_with_its_date_and_source():
    price = pricing.node_hour_price("Standard_ND96isr_H100_v5", "eastus")
    assert price is not None
    assert price.usd_per_hour == TABLE["vm_hourly"]["Standard_ND96isr_H100_v5"]["eastus"]["usd"]
    assert str(price.as_of) == TABLE["as_of"] and "2026-09-16" in price.source and price.estimate is None
    assert price.cost_of(2.5) == Decimal("245.8000")
    estimated = pricing.node_hour_price("Standard_ND96isr_H100_v5", "westeurope")
    assert estimated is not None and "Windows" in (estimated.estimate or "")


@pytest.mark.parametrize(("sku", "region"), [("Standard_NC6", "eastus"), ("Standard_ND96isr_H100_v5", "mars")])
def test_node_hour_price_is_none_where_the_table_has_no_price(sku, region):
    assert pricing.node_hour_price(sku, region) is None


@pytest.mark.parametrize(
    ("size", "tier"), [(32, "P4"), (128, "P10"), (1023, "P30"), (1024, "P30"), (1025, "P40"), (32767, "P80")]
)
def test_a_disk_is_billed_at_the_smallest_premium_tier_that_holds_it(size, tier):
    assert pricing.premium_ssd_tier(size) == tier


def test_every_quote_in_the_shipped_table_is_a_known_size_region_and_source():
    table = pricing.load_price_table()
    assert set(table.vm_hourly) <= set(pricing.GPU_SKUS) | {"Standard_B2s", "Standard_D4s_v5", "Standard_D16s_v5"}
    assert set(table.premium_ssd_monthly) <= {tier for tier, _ in pricing.PREMIUM_SSD_TIERS}
    for section in ("vm_hourly", "premium_ssd_monthly", "registry_daily"):
        for regions in getattr(table, section).values():
            assert set(regions) <= set(pricing.COMMON_REGIONS)


def test_spot_nodes_are_priced_at_the_spot_price_or_at_most_on_demand() -> None:
    cfg = dev_config().model_copy(update={"spot_node_count": 3})
    rows = {row.item: row for row in pricing.estimate_cost(cfg, pricing.load_price_table()).rows}
    spot, on_demand = TABLE["vm_spot_hourly"][cfg.gpu_sku][cfg.location]["usd"], TABLE["vm_hourly"][cfg.gpu_sku]
    assert rows["Spot GPU nodes, running"].usd_per_hour == per_hour(3 * spot)
    assert rows["GPU nodes, running"].basis == f"${on_demand[cfg.location]['usd']}/h"  # both prices side by side
    elsewhere = cfg.model_copy(update={"location": "eastus2"})  # no Spot price there in the table
    row = next(
        r for r in pricing.estimate_cost(elsewhere, pricing.load_price_table()).rows if r.item.startswith("Spot")
    )
    assert row.usd_per_hour == per_hour(3 * on_demand["eastus2"]["usd"])
    assert row.basis.endswith("(no Spot price in the table)")
    assert "Spot" not in {
        r.item.split()[0] for r in pricing.estimate_cost(dev_config(), pricing.load_price_table()).rows
    }
