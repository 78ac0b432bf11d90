"""The local cluster's telemetry: the real Prometheus and node_exporter (Debian's packages), as on Azure.

* every node runs node_exporter on its own address (contract.NODE_EXPORTER_PORT), inside the node
  (it ends when the node is switched off, and starts again with it), with a few cheap collectors and
  the textfile collector reading STATE/telemetry/<node>;
* on a cluster with emulated GPUs, every node runs the GPU stand-in (dtrain/local/gpu_exporter.py),
  which writes the DCGM exporter's metrics into that textfile directory;
* Prometheus runs in the head namespace (contract.PROMETHEUS_PORT on the head's address, which this
  machine reaches over the bridge), with infra's configuration (infra/cloud_init/prometheus.py) and
  its targets rendered from the node list, data in STATE/prometheus, retention bounded by size.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dtrain.checks import require_tool
from dtrain.cluster.description import REPO_ROOT
from dtrain.errors import ExitCode, OperatorError
from dtrain.fileio import atomic_write
from dtrain.local.daemons import http_answers, log_tail, wait_port
from dtrain.local.nodes import enter_node, exporter_roles, start_daemon
from dtrain.local.slurm_conf import SlurmFiles
from dtrain.local.state import LocalState, NodeState
from infra.cloud_init.prometheus import render_prometheus_config, render_scrape_targets
from infra.contract import NODE_EXPORTER_PORT, PROMETHEUS_PORT

PROMETHEUS = "/usr/bin/prometheus"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
INSTALL_HINT = "apt-get install prometheus prometheus-node-exporter (make system)"
ROLE = "prometheus"
SCRAPE_INTERVAL_S = 2  # short: tests watch a job go idle within seconds; two nodes' scrapes cost little
RETENTION_SIZE = "256MB"
# Cheap ones only (CI's session cluster starts them too): CPU, memory, network, disks, and the GPU stand-in.
COLLECTORS = ("cpu", "meminfo", "loadavg", "netdev", "filesystem", "textfile")
START_WAIT_S = 30


def require_tools() -> None:
    for tool in (PROMETHEUS, NODE_EXPORTER):
        require_tool(tool, INSTALL_HINT)


def textfile_dir(state: LocalState, hostname: str) -> Path:
    """The node's textfile collector directory, where its GPU stand-in writes."""
    return SlurmFiles(Path(state.state_dir)).telemetry(hostname)


def prometheus_url(state: LocalState) -> str:
    """Where Prometheus answers, from this machine (the local cluster's login host)."""
    assert state.head is not None  # netns mode: the head namespace exists
    return f"http://{state.head.address}:{PROMETHEUS_PORT}"


def start(state: LocalState) -> None:
    """Every node's exporters, then Prometheus; returns once all of them listen."""
    for node in state.nodes:
        start_node(state, node)
    assert state.head is not None and state.head.namespace
    directory = Path(state.state_dir) / "prometheus"
    (directory / "data").mkdir(parents=True, exist_ok=True)
    targets = directory / "targets.json"
    atomic_write(targets, render_scrape_targets([(n.hostname, n.address) for n in state.nodes], dcgm_exporter=False))
    config = directory / "prometheus.yml"
    atomic_write(config, render_prometheus_config(str(targets), SCRAPE_INTERVAL_S))
    argv = [
        *("ip", "netns", "exec", state.head.namespace, PROMETHEUS),
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--storage.tsdb.retention.size={RETENTION_SIZE}",
        f"--web.listen-address={state.head.address}:{PROMETHEUS_PORT}",
    ]
    start_daemon(state, ROLE, argv, str(config))
    for node in state.nodes:
        what = f"node_exporter of {node.hostname}"
        wait_port(node.address, NODE_EXPORTER_PORT, START_WAIT_S, what, _log(state, node))
    wait_port(state.head.address, PROMETHEUS_PORT, START_WAIT_S, "Prometheus", state.logs / f"{ROLE}.log")
    _wait_ready(state)


def _wait_ready(state: LocalState) -> None:
    """Until Prometheus answers queries: it listens before its storage is open, and answers 503 meanwhile."""
    if not http_answers(f"{prometheus_url(state)}/-/ready", START_WAIT_S):
        log = log_tail(state.logs / f"{ROLE}.log")
        raise OperatorError(f"Prometheus was not ready within {START_WAIT_S}s{log}", ExitCode.TIMED_OUT)


def start_node(state: LocalState, node: NodeState) -> None:
    """The node's exporters that are not running (at `up`, and when a stopped node starts again)."""
    exporter, gpus = exporter_roles(node.hostname)
    directory = textfile_dir(state, node.hostname)
    directory.mkdir(parents=True, exist_ok=True)
    if not _running(state, exporter):
        argv = [
            NODE_EXPORTER,
            f"--web.listen-address={node.address}:{NODE_EXPORTER_PORT}",
            "--collector.disable-defaults",
            *(f"--collector.{name}" for name in COLLECTORS),
            f"--collector.textfile.directory={directory}",
        ]
        start_daemon(state, exporter, [*enter_node(state, node), *argv], NODE_EXPORTER)
    if state.gpus_per_node and not _running(state, gpus):
        module = [sys.executable, "-m", "dtrain.local.gpu_exporter", "--node", node.hostname]
        job_map = SlurmFiles(Path(state.state_dir)).job_map(node.hostname)  # Slurm's prolog and epilog keep it
        argv = [*module, "--gpus", str(state.gpus_per_node), "--dir", str(directory)]
        argv += ["--hpc-job-mapping-dir", str(job_map)]
        start_daemon(state, gpus, [*enter_node(state, node), "env", f"PYTHONPATH={REPO_ROOT}", *argv], module[2])


def _running(state: LocalState, role: str) -> bool:
    record = state.record(role)
    return record is not None and record.alive()


def _log(state: LocalState, node: NodeState) -> Path:
    return state.logs / f"{exporter_roles(node.hostname)[0]}.log"
