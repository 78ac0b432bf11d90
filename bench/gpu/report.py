"""What ``python -m bench.gpu`` measures and writes: a row per figure, a section per kind of work.

A section is a name, a title and a function that takes a scratch directory and returns its rows;
``bench.gpu.SECTIONS`` lists them, so adding one is one line there. Pure stdlib: the tests build
rows by hand and check what is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GiB = 2**30


@dataclass
class Row:
    """One figure: ours beside a plain-PyTorch baseline of the same work, on the same GPU.

    Rates are in ``unit`` (higher is better); ``*_wall_s`` is the whole process, start-up and
    compilation included; ``*_peak_gib`` the CUDA allocator's peak; ``*_mfu`` a fraction.
    """

    section: str
    name: str
    unit: str
    ours: float | None
    baseline: float | None
    baseline_label: str
    ours_mfu: float | None = None
    baseline_mfu: float | None = None
    ours_peak_gib: float | None = None
    baseline_peak_gib: float | None = None
    ours_wall_s: float | None = None
    baseline_wall_s: float | None = None
    command: str = ""
    baseline_command: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.baseline:
            return None
        return self.ours / self.baseline

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": self.ratio}


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    rows: Callable[[Path], list[Row]]


def failed_row(section: Section, error: str) -> Row:
    """The row a section leaves when it fails, so the report says so beside the others."""
    return Row(section.name, section.title, "", None, None, "", note=f"failed: {error.splitlines()[0][:200]}")


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(rows: Sequence[Row], context: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in context["versions"].items())
    lines = [
        "# GPU benchmark: our jobs beside plain PyTorch on the same GPU",
        "",
        f"`{context['command']}` on **{context['device']}** ({context['date']}, {context['elapsed_s']:.0f} s); "
        f"{versions}. Ratio = ours / baseline (higher is better). Wall = the whole process, start-up and "
        "compilation included. See docs/performance.md (GPU figures) for the method.",
        "",
        "| figure | unit | ours | baseline | ratio | MFU ours / baseline | peak GiB ours / baseline "
        "| wall s ours / baseline | baseline is |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
        lines.append(
            f"| {row.name} | {row.unit} | {_number(row.ours)} | {_number(row.baseline)} | {ratio} "
            f"| {_percent(row.ours_mfu)} / {_percent(row.baseline_mfu)} "
            f"| {_number(row.ours_peak_gib, 1)} / {_number(row.baseline_peak_gib, 1)} "
            f"| {_number(row.ours_wall_s)} / {_number(row.baseline_wall_s)} | {row.baseline_label} |"
        )
    notes = [f"- {row.name}: {row.note}" for row in rows if row.note]
    commands = [f"- {row.name}: `{row.command}` beside `{row.baseline_command}`" for row in rows if row.command]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if commands:
        lines += ["", "Commands:", "", *commands]
    if context["failed_sections"]:
        lines += ["", f"Failed sections: {', '.join(context['failed_sections'])}."]
    return "\n".join(lines) + "\n"


def write(rows: Sequence[Row], context: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``results-gpu.json`` and ``results-gpu.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results-gpu.json", out / "results-gpu.md"
    document = {"context": context, "rows": [row.as_dict() for row in rows]}
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    md_path.write_text(markdown(rows, context))
    return json_path, md_path
