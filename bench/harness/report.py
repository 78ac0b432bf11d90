"""results.md: the run's context, the side-by-side table, and the scaling model beside the anchors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.harness.results import Figure, markdown_table
from bench.harness.scaling_model import (
    ANCHORS,
    GB,
    H100_BATCH,
    H100_PLANNING_IMAGES_S,
    ND_H100_V5,
    h100_projection,
    implied_bus_gbps,
)


def model_rows() -> list[dict[str, Any]]:
    """Each anchor: its published efficiency, the model's, and the busBW that would explain it."""
    rows = []
    for a in ANCHORS:
        rows.append(
            {
                "anchor": a.name,
                "gpus": a.workers,
                "published_efficiency": round(a.measured_efficiency, 3),
                "model_efficiency": round(a.predicted(), 3),
                "model_efficiency_no_overlap": round(a.predicted(overlap=0.0), 3),
                "cluster": a.cluster.name,
                "bus_gbps": a.cluster.bus_bw(math.ceil(a.workers / a.cluster.gpus_per_node)) / GB,
                "implied_bus_gbps_no_overlap": round(implied_bus_gbps(a.workload, a.workers, a.measured_efficiency), 2),
                "source": a.source,
            }
        )
    return rows


def projection_rows() -> list[dict[str, Any]]:
    fp32 = dict(h100_projection())
    fp16 = dict(h100_projection(fp16_grads=True))
    return [
        {"nodes": n, "gpus": 8 * n, "efficiency_fp32_grads": round(e, 4), "efficiency_fp16_grads": round(fp16[n], 4)}
        for n, e in fp32.items()
    ]


def markdown(figures: Sequence[Figure], context: dict[str, Any]) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{context['command']}`  ",
        f"Date: {context['date']}; machine: {context['cpus']} CPUs ({context['cpu_model']}); "
        f"wall time {context['elapsed_s']:.0f} s; load average before/after each section: "
        + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in context["load"].items()),
        "",
        "Ratios are medians of interleaved rounds (ours / baseline per round). "
        f"Training-step shape: {context['shape']}.",
        "",
        markdown_table(figures),
        "",
    ]
    notes = [f"- {f.key}: {f.note}" for f in figures if f.note]
    if notes:
        lines += ["Notes:", *notes, ""]
    lines += [
        "## Scaling model beside the anchors",
        "",
        "| anchor | GPUs | published | model (overlap 0.5) | model (no overlap) | busBW assumed "
        "| busBW that explains it |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in model_rows():
        lines.append(
            f"| {r['anchor']} | {r['gpus']} | {r['published_efficiency']:.2f} | {r['model_efficiency']:.2f} | "
            f"{r['model_efficiency_no_overlap']:.2f} | {r['bus_gbps']:g} GB/s | "
            f"{r['implied_bus_gbps_no_overlap']:g} GB/s |"
        )
    lines += [
        "",
        f"Projection, ResNet-50 on {ND_H100_V5.name}, {H100_PLANNING_IMAGES_S} img/s per GPU at batch "
        f"{H100_BATCH} (the issue's per-H100 goal, not a measurement):",
        "",
        "| nodes | GPUs | efficiency, fp32 gradients | efficiency, fp16 gradients |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['nodes']} | {r['gpus']} | {r['efficiency_fp32_grads']:.3f} | {r['efficiency_fp16_grads']:.3f} |"
        for r in projection_rows()
    ]
    return "\n".join(lines) + "\n"
