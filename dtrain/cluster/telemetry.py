"""The cluster's Prometheus, asked from the operator's machine through the Slurm login host (which
reaches it inside the private network: no port of it is open to the operator), and what its answers
say about jobs: which running job's GPUs have been idle.

A job's GPUs are the ones Slurm gave it, per node (`scontrol -d show job`: `Nodes=... GRES=gpu:N(IDX:..)`),
matched to the DCGM exporter's series by the scrape target's `node` label (infra/cloud_init/prometheus.py)
and the series' `gpu` index. Runs on the operator's machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import q
from infra.cloud_init.prometheus import NODE_LABEL

IDLE_UTIL_PERCENT = 5  # at most this busy, at every sample of the window: idle (a waiting GPU reads 0-2 %)
QUERY_TIMEOUT_S = 10
_GPUS_MARK, _PROM_MARK = "@@gpus", "@@prometheus"


class TelemetryUnavailable(Exception):
    """Prometheus did not answer (not running, or the cluster has none): the caller goes on without it."""


@dataclass(frozen=True)
class GpuActivity:
    """What Prometheus says of the GPUs over a window: (node, gpu index) -> the highest utilisation seen."""

    window_s: int
    busiest: Mapping[tuple[str, int], float]

    def idle(self, gpus: Iterable[tuple[str, int]]) -> bool | None:
        """True when every one of the GPUs stayed at or below IDLE_UTIL_PERCENT; None when one has no series."""
        seen = [self.busiest.get(gpu) for gpu in gpus]
        if not seen or any(value is None for value in seen):
            return None
        return all(value <= IDLE_UTIL_PERCENT for value in seen if value is not None)


def parse_indices(text: str) -> list[int]:
    """Slurm's GPU index list (`0`, `0-3`, `0,2-3`) as indices."""
    indices: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            indices.extend(range(int(first), int(last or first) + 1))
    return indices


def job_gpus_script(job_ids: Sequence[str]) -> str:
    """Shell for the login host: one `JOB NODE INDICES` line per node of each job that holds GPUs there."""
    ids = " ".join(q(job) for job in job_ids)
    return (
        f'for j in {ids}; do scontrol -d show job "$j" 2>/dev/null | '
        r"sed -n 's/^ *Nodes=\([^ ]*\) .*IDX:\([^)]*\)).*/\1 \2/p' | "
        'while read -r hosts idx; do for n in $(scontrol show hostnames "$hosts"); do echo "$j $n $idx"; done; done; '
        "done"
    )


def parse_job_gpus(text: str) -> dict[str, list[tuple[str, int]]]:
    """job -> [(node, gpu index)] from job_gpus_script's output."""
    found: dict[str, list[tuple[str, int]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            found.setdefault(parts[0], []).extend((parts[1], index) for index in parse_indices(parts[2]))
    return found


def busiest_query(window_s: int) -> str:
    """PromQL: each GPU's highest utilisation over the window."""
    return f"max by ({NODE_LABEL}, gpu) (max_over_time(DCGM_FI_DEV_GPU_UTIL[{window_s}s]))"


def query_script(desc: ClusterDescription, promql: str) -> str:
    """Shell for the login host: Prometheus's answer to an instant query, as JSON."""
    if desc.telemetry is None:
        raise TelemetryUnavailable(f"the cluster {desc.name!r} has no Prometheus")
    url = f"{desc.telemetry.prometheus_url}/api/v1/query"
    return f"curl -sf --max-time {QUERY_TIMEOUT_S} --get --data-urlencode {q('query=' + promql)} {q(url)}"


def parse_vector(text: str) -> list[tuple[dict[str, str], float]]:
    """An instant query's answer: [(labels, value)]."""
    try:
        answer = json.loads(text)
        return [(item["metric"], float(item["value"][1])) for item in answer["data"]["result"]]
    except (ValueError, KeyError, TypeError, IndexError):
        raise TelemetryUnavailable("Prometheus gave no usable answer") from None


def idle_jobs(desc: ClusterDescription, slurm: Slurm, job_ids: Sequence[str], window_s: int) -> dict[str, bool]:
    """job id -> whether its GPUs were idle over the last window_s, for those of the (running) jobs that hold
    GPUs (one round trip to the login host). Raises TelemetryUnavailable."""
    if not job_ids:
        return {}
    script = f"echo {_GPUS_MARK}; {job_gpus_script(job_ids)}; echo {_PROM_MARK}; "
    answer = slurm.run_unchecked(script + query_script(desc, busiest_query(window_s)), timeout=60).stdout
    gpu_text, _, prom_text = answer.partition(f"{_PROM_MARK}\n")
    if not prom_text.strip():
        raise TelemetryUnavailable("Prometheus did not answer")
    busiest = {
        (labels.get(NODE_LABEL, ""), int(labels.get("gpu", -1))): value for labels, value in parse_vector(prom_text)
    }
    activity = GpuActivity(window_s, busiest)
    verdicts = {job: activity.idle(gpus) for job, gpus in parse_job_gpus(gpu_text.removeprefix(_GPUS_MARK)).items()}
    return {job: verdict for job, verdict in verdicts.items() if verdict is not None}
