"""A stand-in for NVIDIA's DCGM exporter on the local cluster's emulated GPUs (dtrain/local/gpus.py).

Runs inside a node's namespaces (its process table), one per node, started by dtrain/local/telemetry.py:
every few seconds it writes the DCGM exporter's metric names for each of the node's GPUs into a file
that the node's node_exporter serves (its textfile collector). Every series says what it is: the
label `emulated="1"`, the model name, and each HELP line.

An emulated GPU has no counters of its own, so its utilisation is derived from real activity: the
CPU time that the processes Slurm gave it (SLURM_STEP_GPUS, or SLURM_JOB_GPUS in the batch step:
the node's GPU indices) spent since the last sample, over the wall time, as a percentage (a process
holding two GPUs counts half on each). A job whose ranks are stopped (SIGSTOP) or hung reads 0, as a
real GPU that waits for its host does. Memory used is those processes' resident memory; power and
temperature follow the utilisation. XID errors are 0 unless a test writes a count into
`<dir>/xid-<gpu>` (a stand-in for the driver's report).

Jobs are labelled as NVIDIA's exporter labels them from `--hpc-job-mapping-dir`: a GPU whose file in that
directory (named by its index, one job id per line: Slurm's prolog writes it, the epilog empties it,
dtrain/remote/slurm/) names jobs gets one series per job, labelled `hpc_job="<id>"`; any other GPU one
series without the label.

  python -m dtrain.local.gpu_exporter --node node-0 --gpus 2 --dir STATE/telemetry/node-0 \
      --hpc-job-mapping-dir STATE/telemetry/node-0/hpc-jobs
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

METRICS_FILE = "dcgm.prom"  # node_exporter's textfile collector reads *.prom
INTERVAL_S = 2.0
MODEL = "emulated GPU (dtrain local stand-in for DCGM)"
FB_TOTAL_MIB = 16384
IDLE_POWER_W, FULL_POWER_W = 50.0, 300.0
IDLE_TEMP_C, FULL_TEMP_C = 30.0, 70.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20
GPU_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")  # the node's own indices; the step's first

# name -> (type, help); the DCGM exporter's names and units
METRICS = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered."),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("gauge", "Current clock throttle reasons (bitmask)."),
}
STAND_IN = "Emulated: the local cluster's stand-in for NVIDIA's DCGM exporter, derived from host CPU activity."


@dataclass(frozen=True)
class Sample:
    """One process that holds GPUs: its CPU seconds so far and resident memory."""

    gpus: tuple[int, ...]
    cpu_s: float
    rss_mib: float


def held_gpus(environ: bytes) -> tuple[int, ...]:
    """The GPU indices a process's environment (/proc/PID/environ) says Slurm gave it."""
    env = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    for name in GPU_VARIABLES:
        value = env.get(name.encode(), b"").decode(errors="replace")
        indices = tuple(int(part) for part in value.split(",") if part.strip().isdigit())
        if indices:
            return indices
    return ()


def sample(proc: Path = Path("/proc")) -> dict[tuple[int, int], Sample]:
    """(pid, start time) -> Sample, for every process that holds a GPU (processes come and go: skip those gone)."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            gpus = held_gpus((entry / "environ").read_bytes())
            if not gpus:
                continue
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            rss_pages = int((entry / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        # after the command's ')': state is fields[0], so utime/stime/starttime (man 5 proc: 14, 15, 22) shift by 3
        cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        found[(int(entry.name), int(fields[19]))] = Sample(gpus, cpu_s, rss_pages * PAGE_MIB)
    return found


def utilisation(
    before: Mapping[tuple[int, int], Sample], after: Mapping[tuple[int, int], Sample], seconds: float, gpus: int
) -> dict[int, tuple[float, float]]:
    """gpu -> (utilisation %, memory used MiB) between two samples `seconds` apart."""
    busy = [0.0] * gpus
    memory = [0.0] * gpus
    for key, now in after.items():
        share = 1 / len(now.gpus)
        spent = now.cpu_s - before[key].cpu_s if key in before else 0.0
        for gpu in now.gpus:
            if 0 <= gpu < gpus:
                busy[gpu] += spent * share
                memory[gpu] += now.rss_mib * share
    return {gpu: (min(100.0, 100 * busy[gpu] / max(seconds, 1e-3)), memory[gpu]) for gpu in range(gpus)}


def render(
    node: str,
    readings: Mapping[int, tuple[float, float]],
    xids: Mapping[int, int],
    jobs: Mapping[int, Sequence[str]] | None = None,
) -> str:
    """The metrics file: each metric's HELP and TYPE, and one series per GPU, or per GPU and job where
    ``jobs`` (gpu -> the ids of the jobs on it) names any."""
    values: dict[str, dict[int, float]] = {name: {} for name in METRICS}
    for gpu, (util, used) in readings.items():
        used = min(used, FB_TOTAL_MIB)
        values["DCGM_FI_DEV_GPU_UTIL"][gpu] = round(util)
        values["DCGM_FI_DEV_FB_USED"][gpu] = round(used)
        values["DCGM_FI_DEV_FB_FREE"][gpu] = round(FB_TOTAL_MIB - used)
        values["DCGM_FI_DEV_POWER_USAGE"][gpu] = round(IDLE_POWER_W + (FULL_POWER_W - IDLE_POWER_W) * util / 100, 1)
        values["DCGM_FI_DEV_GPU_TEMP"][gpu] = round(IDLE_TEMP_C + (FULL_TEMP_C - IDLE_TEMP_C) * util / 100)
        values["DCGM_FI_DEV_XID_ERRORS"][gpu] = xids.get(gpu, 0)
        values["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"][gpu] = 0
    lines = []
    for name, (kind, text) in METRICS.items():
        lines += [f"# HELP {name} {text} {STAND_IN}", f"# TYPE {name} {kind}"]
        for gpu, value in sorted(values[name].items()):
            labels = (
                f'gpu="{gpu}",UUID="GPU-emulated-{node}-{gpu}",device="nvidia{gpu}",'
                f'modelName="{MODEL}",Hostname="{node}",emulated="1"'
            )
            for job in (jobs or {}).get(gpu) or [None]:
                job_label = "" if job is None else f',hpc_job="{job}"'
                lines.append(f"{name}{{{labels}{job_label}}} {value:g}")
    return "\n".join(lines) + "\n"


def injected_xids(directory: Path, gpus: Iterable[int]) -> dict[int, int]:
    """XID error counts a test wrote (<dir>/xid-<gpu>), for GPUs that have one."""
    found = {}
    for gpu in gpus:
        try:
            found[gpu] = int((directory / f"xid-{gpu}").read_text().strip())
        except (OSError, ValueError):
            continue
    return found


def job_mapping(directory: Path | None, gpus: Iterable[int]) -> dict[int, list[str]]:
    """gpu -> the job ids its mapping file names (numbers only: they become label values)."""
    found: dict[int, list[str]] = {}
    for gpu in gpus if directory is not None else ():
        try:
            lines = (directory / str(gpu)).read_text().split()
        except OSError:
            continue
        if ids := [line for line in lines if line.isdigit()]:
            found[gpu] = ids
    return found


def serve(node: str, gpus: int, directory: Path, interval_s: float, job_map: Path | None = None) -> None:
    """Write the metrics file every interval_s, until stopped (with the node)."""
    directory.mkdir(parents=True, exist_ok=True)
    target, scratch = directory / METRICS_FILE, directory / f".{METRICS_FILE}.tmp"
    before, then = sample(), time.monotonic()
    while True:
        time.sleep(interval_s)
        after, now = sample(), time.monotonic()
        readings = utilisation(before, after, now - then, gpus)
        jobs = job_mapping(job_map, range(gpus))
        scratch.write_text(render(node, readings, injected_xids(directory, range(gpus)), jobs))
        scratch.replace(target)  # whole or not at all: node_exporter may read it at any time
        before, then = after, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", required=True, help="the node's Slurm name (the Hostname label)")
    parser.add_argument("--gpus", type=int, required=True, help="the node's emulated GPUs")
    parser.add_argument("--dir", type=Path, required=True, help="node_exporter's textfile directory")
    parser.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between samples")
    parser.add_argument("--hpc-job-mapping-dir", type=Path, help="Slurm's GPU-to-job files: the hpc_job label")
    args = parser.parse_args()
    serve(args.node, args.gpus, args.dir, args.interval, args.hpc_job_mapping_dir)


if __name__ == "__main__":
    main()
