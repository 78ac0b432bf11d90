"""Figures, their goals, and the JSON and Markdown they are written as (pure: stdlib only)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, BELOW, INFO, SKIPPED = "PASS", "BELOW", "info", "SKIPPED"


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return statistics.median(values)


def paired_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """Median of the per-round ratios ours/baseline.

    Rounds interleave the two, so a burst of load from a neighbour hits one pair, and the
    median of pair ratios discards it; a ratio of two medians would mix different moments.
    """
    if len(ours) != len(baseline) or not ours:
        raise ValueError(f"need equal, non-empty rounds, got {len(ours)} and {len(baseline)}")
    if any(b <= 0 for b in baseline):
        raise ValueError("baseline values must be positive")
    return median([o / b for o, b in zip(ours, baseline, strict=True)])


@dataclass
class Figure:
    """One line of the table: ours against a baseline, as a ratio with an optional goal.

    ``higher_is_better`` is False for goals that are ceilings. ``ours`` and ``baseline``
    are medians in ``unit``; ``samples`` keeps the raw rounds for the JSON.
    """

    key: str
    title: str
    unit: str
    ours: float | None
    baseline: float | None
    ratio: float | None
    goal: float | None = None
    ours_label: str = "ours"
    baseline_label: str = "baseline"
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)
    skipped_reason: str = ""

    @property
    def status(self) -> str:
        if self.skipped_reason or self.ratio is None:
            return SKIPPED
        if self.goal is None:
            return INFO
        return PASS if self.ratio >= self.goal else BELOW

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}

    @classmethod
    def skipped(cls, key: str, title: str, reason: str) -> Figure:
        return cls(key, title, "", None, None, None, skipped_reason=reason)

    @classmethod
    def from_rounds(
        cls,
        key: str,
        title: str,
        unit: str,
        ours: Sequence[float],
        baseline: Sequence[float],
        **kwargs: Any,
    ) -> Figure:
        return cls(
            key,
            title,
            unit,
            median(ours),
            median(baseline),
            paired_ratio(ours, baseline),
            samples={"ours": list(ours), "baseline": list(baseline)},
            **kwargs,
        )


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def markdown_table(figures: Sequence[Figure]) -> str:
    """The side-by-side table: both medians, the ratio, the goal and PASS/BELOW."""
    lines = [
        "| # | figure | ours | baseline | unit | ratio | goal | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, fig in enumerate(figures, 1):
        if fig.status == SKIPPED:
            lines.append(f"| {i} | {fig.title} | - | - | - | - | - | SKIPPED: {fig.skipped_reason} |")
            continue
        ours = f"{_num(fig.ours)} ({fig.ours_label})"
        base = f"{_num(fig.baseline)} ({fig.baseline_label})"
        goal = f">= {fig.goal:g}" if fig.goal is not None else "-"
        lines.append(f"| {i} | {fig.title} | {ours} | {base} | {fig.unit} | {fig.ratio:.3f} | {goal} | {fig.status} |")
    return "\n".join(lines)


def to_json(figures: Sequence[Figure], context: dict[str, Any], extra: dict[str, Any]) -> str:
    return json.dumps({"context": context, "figures": [f.to_json() for f in figures], **extra}, indent=2, default=str)
