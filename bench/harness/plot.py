"""The PNG: measured ratios against their goals, and the scaling model beside the anchors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on build machines; must precede the pyplot import
import matplotlib.pyplot as plt

from bench.harness.results import BELOW, PASS, Figure
from bench.harness.scaling_model import ANCHORS, h100_projection

COLORS = {PASS: "#2a9d8f", BELOW: "#e76f51"}


def write_png(figures: Sequence[Figure], path: Path) -> None:
    shown = [f for f in figures if f.ratio is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f.key for f in shown]
    left.barh(labels, [f.ratio for f in shown], color=[COLORS.get(f.status, "#8d99ae") for f in shown])
    for y, f in enumerate(shown):
        if f.goal is not None:
            left.plot([f.goal, f.goal], [y - 0.4, y + 0.4], color="black", linewidth=2)
        left.text(f.ratio, y, f" {f.ratio:.2f}", va="center")
    left.invert_yaxis()
    left.set_xlabel("ratio ours / baseline (black bar: goal; green PASS, red BELOW, grey info)")
    left.set_title("Measured on this machine, same run")

    for fp16 in (False, True):
        points = h100_projection(fp16_grads=fp16)
        right.plot(
            [8 * n for n, _ in points],
            [e for _, e in points],
            marker="o",
            label=f"model: ND H100 v5, ResNet-50 {'fp16' if fp16 else 'fp32'} grads",
        )
    for anchor in ANCHORS:
        right.scatter(anchor.workers, anchor.measured_efficiency, marker="*", s=160, label=f"published: {anchor.name}")
        right.scatter(anchor.workers, anchor.predicted(), marker="x", s=80, color="grey")
    right.set_xscale("log", base=2)
    right.set_ylim(0.4, 1.02)
    right.set_xlabel("GPUs")
    right.set_ylabel("scaling efficiency")
    right.set_title("Analytical model (x: model at the anchor's inputs)")
    right.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
