#!/usr/bin/env python3
"""A job's system metrics in its MLflow run, per node: run by the batch script on the first node of the
allocation, in the background, for as long as the job runs (any job: ours or the user's own code).

  system_metrics.py --run-dir DIR --prometheus URL --job ID --nodes node-0,node-1 [--interval 10]

Every interval it asks the cluster's Prometheus for the job's GPUs (the DCGM exporter's series labelled
hpc_job="<id>" by Slurm's prolog: this job's GPUs only, not those of a job sharing the node) and its
nodes' node_exporter series, and logs them to the run (``$MLFLOW_RUN_ID`` at ``$MLFLOW_TRACKING_URI``)
under MLflow's own system-metric names with the node as prefix, ``system/<node>/gpu_0_utilization_percentage``,
so that the run's "System metrics" tab charts them beside its loss. On Azure the GPU series come from
NVIDIA's DCGM exporter, locally from its stand-in (dtrain/local/gpu_exporter.py): one source for the
cluster's telemetry and for MLflow.

Why not MLflow's own monitor (mlflow.system_metrics): it runs in a process that imports mlflow, psutil
and pynvml (not in our images, where TensorFlow's protobuf pin keeps mlflow out, nor in the user's),
reads every GPU of the node through NVML (a job sharing a node would chart its neighbour's), and stops
for good at the first request that fails. Values a slow server did not take are sent with the next
sample (a bounded backlog); a server that is down costs the oldest of them. Standard library only (and
mlflow_run.py, beside it in the run's remote/): the nodes' system python runs it, outside the image.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from mlflow_run import RUN_ID_FILE, TOKEN, request, token_from_secrets  # beside this file in the run's remote/

INTERVAL_S = 10.0  # MLflow's monitor samples every 10 s too
QUERY_TIMEOUT_S = 5.0
RATE_WINDOW = "1m"  # at least four of Azure's 15 s scrapes
BACKLOG = 2000  # values kept for a server that did not take them; past that the oldest go
BATCH = 1000  # MLflow's limit per log-batch request
MIB_MB = 2**20 / 1e6  # the DCGM exporter counts MiB, MLflow's names say megabytes
NODE_LABEL = "node"  # the scrape target's label (infra/cloud_init/prometheus.py)


def gpu_queries(job: str) -> dict[str, str]:
    """MLflow's GPU metric name (with {gpu}) -> PromQL over the job's GPUs."""
    used, free = f'DCGM_FI_DEV_FB_USED{{hpc_job="{job}"}}', f'DCGM_FI_DEV_FB_FREE{{hpc_job="{job}"}}'
    return {
        "gpu_{gpu}_utilization_percentage": f'DCGM_FI_DEV_GPU_UTIL{{hpc_job="{job}"}}',
        "gpu_{gpu}_memory_usage_megabytes": f"{used} * {MIB_MB}",
        "gpu_{gpu}_memory_usage_percentage": f"100 * {used} / ({used} + {free})",
        "gpu_{gpu}_power_usage_watts": f'DCGM_FI_DEV_POWER_USAGE{{hpc_job="{job}"}}',
    }


def node_queries(nodes: list[str]) -> dict[str, str]:
    """MLflow's host metric name -> PromQL over the job's nodes (node_exporter's series)."""
    # each name a literal in the regular expression, its backslashes doubled for PromQL's string
    names = "|".join(re.escape(node).replace("\\", "\\\\") for node in nodes)
    which = f'{NODE_LABEL}=~"{names}"'
    by = f"by ({NODE_LABEL})"
    memory = f"node_memory_MemTotal_bytes{{{which}}} - node_memory_MemAvailable_bytes{{{which}}}"
    network = f'{{{which},device!="lo"}}'
    idle = f'rate(node_cpu_seconds_total{{{which},mode="idle"}}[{RATE_WINDOW}])'
    return {
        "cpu_utilization_percentage": f"100 * (1 - avg {by} ({idle}))",
        "system_memory_usage_megabytes": f"({memory}) / 1e6",
        "system_memory_usage_percentage": f"100 * ({memory}) / node_memory_MemTotal_bytes{{{which}}}",
        # totals since boot: the job's share is what grew since its first sample (as MLflow's monitor counts)
        "network_receive_megabytes": f"sum {by} (node_network_receive_bytes_total{network}) / 1e6",
        "network_transmit_megabytes": f"sum {by} (node_network_transmit_bytes_total{network}) / 1e6",
    }


CUMULATIVE = ("network_receive_megabytes", "network_transmit_megabytes")


def query(prometheus: str, promql: str) -> list[tuple[dict[str, str], float]]:
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as answer:
        return [(item["metric"], float(item["value"][1])) for item in json.load(answer)["data"]["result"]]


class Sampler:
    """The job's metrics now, by MLflow name; the cumulative ones counted from the first sample."""

    def __init__(self, prometheus: str, job: str, nodes: list[str]) -> None:
        self.prometheus, self.gpus, self.hosts = prometheus, gpu_queries(job), node_queries(nodes)
        self.baseline: dict[str, float] = {}

    def sample(self, ask: Callable[[str, str], list[tuple[dict[str, str], float]]] = query) -> dict[str, float]:
        found: dict[str, float] = {}
        for pattern, promql in self.gpus.items():
            for labels, value in self._answer(ask, promql):
                name = pattern.format(gpu=labels.get("gpu", "?"))
                found[f"system/{labels.get(NODE_LABEL, '?')}/{name}"] = value
        for name, promql in self.hosts.items():
            for labels, value in self._answer(ask, promql):
                key = f"system/{labels.get(NODE_LABEL, '?')}/{name}"
                if name in CUMULATIVE:
                    value -= self.baseline.setdefault(key, value)
                found[key] = value
        return {key: round(value, 2) for key, value in found.items() if value == value}  # NaN: no JSON

    def _answer(self, ask: Callable, promql: str) -> list[tuple[dict[str, str], float]]:
        try:
            return ask(self.prometheus, promql)
        except (OSError, ValueError, KeyError):  # Prometheus busy or restarting: this sample goes without it
            return []


class Sender:
    """Log-batch requests to the run; what the server did not take goes with the next one (bounded)."""

    def __init__(self, run_id: str, send: Callable[[dict], object]) -> None:
        self.run_id, self.send = run_id, send
        self.backlog: list[dict] = []

    def add(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self.backlog += [{"key": k, "value": v, "timestamp": now, "step": step} for k, v in values.items()]
        del self.backlog[: max(len(self.backlog) - BACKLOG, 0)]

    def flush(self) -> None:
        while self.backlog:
            batch = self.backlog[:BATCH]
            try:
                self.send({"run_id": self.run_id, "metrics": batch})
            except (OSError, ValueError, KeyError):  # slow or down: kept for the next sample
                return
            del self.backlog[: len(batch)]


def run(args: argparse.Namespace, stop: threading.Event) -> None:
    run_id = (args.run_dir / RUN_ID_FILE).read_text().strip()
    started = request("runs/get", {"run_id": run_id}, "GET")["run"]["info"]["start_time"] / 1000
    sampler = Sampler(args.prometheus, args.job, args.nodes.split(","))
    sender = Sender(run_id, lambda body: request("runs/log-batch", body))
    while not stop.wait(args.interval):
        # the step: seconds since the run began, so that a requeued attempt goes on where the last one ended
        sender.add(int(time.time() - started), sampler.sample())
        sender.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--prometheus", required=True, help="the cluster's Prometheus, as the nodes reach it")
    parser.add_argument("--job", required=True, help="the Slurm job id (the GPUs' hpc_job label)")
    parser.add_argument("--nodes", required=True, help="the job's nodes, comma-separated")
    parser.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between samples (%(default)s)")
    args = parser.parse_args(argv)
    if not os.environ.get(TOKEN) and (token := token_from_secrets(args.run_dir)):
        os.environ[TOKEN] = token  # this process's own: it starts none
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the job's end: the last sample's send, then out
    try:
        run(args, stop)
    except (OSError, ValueError, KeyError) as exc:  # the run cannot be read: nothing to log to
        print(f"[job] system metrics are not logged to MLflow: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
