"""The cluster's Prometheus, asked from the operator's machine through the Slurm login host (which
reaches it inside the private network: no port of it is open to the operator), and what its answers
say about jobs: which running job's GPUs have been idle.

A job's GPUs are the ones Slurm gave it, per node (`scontrol -d show job`: `Nodes=... GRES=gpu:N(IDX:..)`),
matched to the DCGM exporter's series by the scrape target's `node` label (contract.PROMETHEUS_NODE_LABEL)
and the series' `gpu` index. Runs on the operator's machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import q
from infra.contract import PROMETHEUS_NODE_LABEL as NODE_LABEL

IDLE_UTIL_PERCENT = 5  # at most this busy, at every sample of the window: idle (a waiting GPU reads 0-2 %)
QUERY_TIMEOUT_S = 10
_MARK = "@@section "
READING_METRICS = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE")
# DCGM's clock throttle (event) reasons that slow a working GPU down; idle and application clocks are not among them
THROTTLE_REASONS = {0x4: "power cap", 0x8: "HW slowdown", 0x40: "SW thermal", 0x80: "HW thermal", 0x100: "power brake"}


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


def run_sections(slurm: Slurm, sections: Mapping[str, str]) -> dict[str, str]:
    """Several shell commands on the login host in one round trip: name -> what each printed."""
    # the mark on a line of its own, whether or not what came before ended its line (curl's JSON does not)
    script = "; ".join(f"echo; echo {_MARK}{name}; {{ {command}; }}" for name, command in sections.items())
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in slurm.run_unchecked(script, timeout=60).stdout.splitlines():
        if line.startswith(_MARK) and line[len(_MARK) :] in sections:
            current = found.setdefault(line[len(_MARK) :], [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in found.items()}


def idle_jobs(desc: ClusterDescription, slurm: Slurm, job_ids: Sequence[str], window_s: int) -> dict[str, bool]:
    """job id -> whether its GPUs were idle over the last window_s, for those of the (running) jobs that hold
    GPUs (one round trip to the login host). Raises TelemetryUnavailable."""
    if not job_ids:
        return {}
    answers = run_sections(
        slurm, {"gpus": job_gpus_script(job_ids), "busiest": query_script(desc, busiest_query(window_s))}
    )
    busiest = {(labels.get(NODE_LABEL, ""), int(labels.get("gpu", -1))): v for labels, v in _vector(answers, "busiest")}
    activity = GpuActivity(window_s, busiest)
    verdicts = {job: activity.idle(gpus) for job, gpus in parse_job_gpus(answers.get("gpus", "")).items()}
    return {job: verdict for job, verdict in verdicts.items() if verdict is not None}


@dataclass(frozen=True)
class GpuReading:
    """A GPU as Prometheus has it now (the DCGM exporter's series)."""

    node: str
    gpu: int
    util_percent: float
    used_mib: float
    total_mib: float


def gpu_queries(desc: ClusterDescription) -> dict[str, str]:
    """The sections (run_sections) that gpu_readings reads."""
    return {name: query_script(desc, f"max by ({NODE_LABEL}, gpu) ({name})") for name in READING_METRICS}


def gpu_readings(answers: Mapping[str, str]) -> list[GpuReading]:
    """Every GPU's reading from the answers to gpu_queries, by node then index."""
    values: dict[tuple[str, int], dict[str, float]] = {}
    for name in READING_METRICS:
        for labels, value in _vector(answers, name):
            values.setdefault((labels.get(NODE_LABEL, ""), int(labels.get("gpu", -1))), {})[name] = value
    return [
        GpuReading(
            node,
            gpu,
            got.get("DCGM_FI_DEV_GPU_UTIL", 0.0),
            got.get("DCGM_FI_DEV_FB_USED", 0.0),
            got.get("DCGM_FI_DEV_FB_USED", 0.0) + got.get("DCGM_FI_DEV_FB_FREE", 0.0),
        )
        for (node, gpu), got in sorted(values.items())
    ]


def gpu_alerts(answers: Mapping[str, str]) -> dict[str, list[str]]:
    """node -> what is wrong with its GPUs (an XID error, clocks throttled by heat or power), from the answer
    to alert_queries."""
    alerts: dict[str, list[str]] = {}
    for labels, value in _vector(answers, "xid"):
        if value > 0:
            alerts.setdefault(labels.get(NODE_LABEL, ""), []).append(f"gpu {labels.get('gpu', '?')}: XID {value:g}")
    for labels, value in _vector(answers, "throttle"):
        reasons = [why for bit, why in THROTTLE_REASONS.items() if int(value) & bit]
        if reasons:
            text = f"gpu {labels.get('gpu', '?')}: throttled ({', '.join(reasons)})"
            alerts.setdefault(labels.get(NODE_LABEL, ""), []).append(text)
    return alerts


def alert_queries(desc: ClusterDescription) -> dict[str, str]:
    """The sections (run_sections) that gpu_alerts reads: the DCGM exporter's last XID, and its throttle
    reasons (the name DCGM 4 gives them, and the older one)."""
    throttle = '{__name__=~"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS|DCGM_FI_DEV_CLOCKS_EVENT_REASONS"}'
    return {"xid": query_script(desc, "DCGM_FI_DEV_XID_ERRORS"), "throttle": query_script(desc, throttle)}


def _vector(answers: Mapping[str, str], name: str) -> list[tuple[dict[str, str], float]]:
    text = answers.get(name, "")
    if not text.strip():
        raise TelemetryUnavailable("Prometheus did not answer")
    return parse_vector(text)
