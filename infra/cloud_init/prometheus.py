"""Prometheus's configuration: the head node's (Azure, written by cloud-init) and the local cluster's
(its head namespace, dtrain/local/telemetry.py), rendered by the same pure functions.

Prometheus scrapes one job, `nodes`, whose targets come from a file (file_sd) that lists, for every
Slurm node, its node_exporter (every node) and its DCGM exporter (GPU nodes on Azure; locally the
emulated GPUs' series travel in node_exporter's textfile collector instead). Each target carries the
label `node` = the node's Slurm name, so that a query can name a job's nodes as Slurm does.

Why file_sd written from Slurm's node list, not Azure's service discovery: Slurm's node list is the
cluster's one record of its nodes (slurm.conf names every scale-set instance a node can be, powered
up or not), so the targets follow it by construction; azure_sd would need the head node's identity to
read the whole subscription's VMs (a wider role than the scale-set-scoped one it holds) and would
name instances by Azure's names rather than Slurm's. A powered-down node is a target that is down,
which Prometheus records as `up == 0`, not an error. Prometheus re-reads the file when it changes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infra.cloud_init._common import write_file
from infra.contract import DCGM_EXPORTER_PORT, NODE_EXPORTER_PORT, PROMETHEUS_NODE_LABEL, PROMETHEUS_PORT

SCRAPE_JOB = "nodes"
NODE_LABEL = PROMETHEUS_NODE_LABEL
EXPORTER_LABEL = "exporter"  # node_exporter or dcgm-exporter


def render_prometheus_config(targets_file: str, scrape_interval_s: int) -> str:
    """prometheus.yml: one scrape job whose targets are in targets_file (render_scrape_targets)."""
    if not 1 <= scrape_interval_s <= 300:
        raise ValueError(f"scrape_interval_s: {scrape_interval_s} is not between 1 and 300")
    # JSON is YAML: no quoting rules of our own to get wrong
    config = {
        "global": {"scrape_interval": f"{scrape_interval_s}s", "evaluation_interval": f"{scrape_interval_s}s"},
        "scrape_configs": [
            {
                "job_name": SCRAPE_JOB,
                "file_sd_configs": [{"files": [targets_file], "refresh_interval": "1m"}],
            }
        ],
    }
    return json.dumps(config, indent=2) + "\n"


def render_scrape_targets(nodes: Sequence[tuple[str, str]], *, dcgm_exporter: bool) -> str:
    """The file_sd document for nodes [(Slurm name, address or host name)]: node_exporter on each,
    and NVIDIA's DCGM exporter too where dcgm_exporter."""
    exporters = [("node_exporter", NODE_EXPORTER_PORT)]
    if dcgm_exporter:
        exporters.append(("dcgm-exporter", DCGM_EXPORTER_PORT))
    groups = [
        {"targets": [f"{address}:{port}"], "labels": {NODE_LABEL: name, EXPORTER_LABEL: exporter}}
        for name, address in nodes
        for exporter, port in exporters
    ]
    return json.dumps(groups, indent=2) + "\n"


# --- Azure: the head node's Prometheus, from Ubuntu's packages --------------------------------------
PROMETHEUS_PACKAGE = "prometheus"  # Ubuntu 22.04's (universe): prometheus.service, reading the paths below
NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"  # every node's; its package starts it on port 9100
CONFIG_PATH = "/etc/prometheus/prometheus.yml"
TARGETS_PATH = "/etc/prometheus/targets.json"
DEFAULTS_PATH = "/etc/default/prometheus"  # the unit's $ARGS
SCRAPE_INTERVAL_S = 15
# Bounded by size, not only by age: the head's OS disk also holds slurmctld's state. 10 GB keeps weeks of
# a 100-node cluster's series at a 15 s interval; the oldest blocks go first.
RETENTION_SIZE = "10GB"


def head_prometheus_files(node_names: Sequence[str]) -> list[dict[str, Any]]:
    """write_files entries for the head node: the configuration, the targets (node_exporter and the DCGM
    exporter of every node Slurm knows, Spot nodes too) and the retention. Listening on every address is
    safe: the head has no public address, and the network rules admit the VNet only."""
    if not node_names:
        raise ValueError("node_names: at least one node")
    args = f'ARGS="--storage.tsdb.retention.size={RETENTION_SIZE} --web.listen-address=:{PROMETHEUS_PORT}"\n'
    return [
        write_file(CONFIG_PATH, render_prometheus_config(TARGETS_PATH, SCRAPE_INTERVAL_S), "0644", defer=True),
        write_file(
            TARGETS_PATH, render_scrape_targets([(n, n) for n in node_names], dcgm_exporter=True), "0644", defer=True
        ),
        write_file(DEFAULTS_PATH, args, "0644", defer=True),
    ]
