"""Figure 3: allreduce of ResNet-50's gradients over gloo (2 processes) against the bandwidth bound."""

from __future__ import annotations

from typing import Any

from bench.harness import proc
from bench.harness.results import Figure, median
from bench.harness.scaling_model import RESNET50_PARAMS, ring_allreduce_s

WORKERS = 2


def run(rounds: int, elements: int = RESNET50_PARAMS) -> dict[str, Any]:
    args = ["--rounds", str(rounds), "--elements", str(elements)]
    return proc.run_json("horovod", WORKERS, "bench.cpu.allreduce_worker", args, threads=1)


def bus_gbps(nbytes: float, seconds: float) -> float:
    """NCCL's bus bandwidth: the per-link rate a ring needs to finish in ``seconds``."""
    return ring_allreduce_s(nbytes, WORKERS, 1.0) / seconds / 1e9


def figures(raw: dict[str, Any]) -> list[Figure]:
    nbytes, s = raw["bytes"], raw["seconds"]
    as_bw = {name: [bus_gbps(nbytes, t) for t in times] for name, times in s.items()}
    mb = nbytes / 1e6
    return [
        Figure.from_rounds(
            "allreduce_fp32",
            f"Allreduce {mb:.0f} MB fp32, gloo, 2 procs: bus bandwidth vs loopback TCP",
            "GB/s",
            as_bw["fp32"],
            as_bw["link"],
            ours_label="hvd.allreduce",
            baseline_label="TCP duplex",
            note=f"memcpy {median(as_bw['memcpy']):.1f} GB/s (same bytes)",
        ),
        Figure.from_rounds(
            "allreduce_fp16",
            "fp16 compression: fp32-equivalent bus bandwidth vs no compression",
            "GB/s",
            as_bw["fp16"],
            as_bw["fp32"],
            ours_label="Compression.fp16",
            baseline_label="Compression.none",
        ),
    ]
