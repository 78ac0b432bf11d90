"""What ``python -m bench.gpu`` measures and writes: a row per figure, a section per kind of work.

A section is a name, a title, a function that takes a scratch directory and the run's
:class:`Scale` and returns its rows, and what it is estimated to cost; ``bench.gpu.SECTIONS``
lists them, so adding one is one line there. Pure stdlib: the tests build rows by hand and check
what is written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GiB = 2**30
# Inductor's FX graph and AOTAutograd caches are on by default (torch 2.11 as 2.13) and shared by
# every process of a run, under /tmp/torchinductor_<user> (TORCHINDUCTOR_CACHE_DIR where set): a
# model compiled again at the same shape (the decode section's ResNet-50, after the resnet50
# section's) loads its compiled code instead of compiling it cold. Set for every measured process
# all the same, so that an environment that turned them off cannot make each compile a cold one.
INDUCTOR_CACHES = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0",
    "TORCH_COMPILE_FORCE_DISABLE_CACHES": "0",
}


@dataclass
class Row:
    """One figure: ours beside a plain-PyTorch baseline of the same work, on the same GPU.

    Rates are in ``unit`` (higher is better); ``*_wall_s`` is the whole process, start-up and
    compilation included; ``*_peak_gib`` the CUDA allocator's peak; ``*_mfu`` a fraction.
    ``terms`` says what both sides had in common (precision, compile mode, optimizer, host syncs,
    the timed steps) and where they differ, so that the ratio is read beside them.
    """

    section: str
    name: str
    unit: str
    ours: float | None
    baseline: float | None
    baseline_label: str
    terms: str = ""
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
class Scale:
    """What every section is given: tiny sizes or the real ones, the device, and when the run's
    ``--budget-s`` ends (``time.monotonic()``), past which no measured process may run."""

    smoke: bool
    cuda: bool
    deadline: float

    def timeout(self, limit: float) -> float:
        """A process's timeout: ``limit``, or less where the budget ends sooner."""
        return max(1.0, min(limit, self.deadline - time.monotonic()))


@dataclass(frozen=True)
class Section:
    """``rows(scratch directory, scale)`` yields each row as soon as it is measured (a failure later in
    the section keeps them); ``cost_s`` and ``smoke_cost_s``: estimated seconds of the
    whole section, process start-up and compilation included (one H100; the smoke on a GPU or on
    the 2-core CI machine, whichever is slower), against which the budget left is checked."""

    name: str
    title: str
    rows: Callable[[Path, Scale], Iterable[Row]]
    cost_s: float
    smoke_cost_s: float

    def cost(self, smoke: bool) -> float:
        return self.smoke_cost_s if smoke else self.cost_s


def failed_row(section: Section, error: str) -> Row:
    """The row a section leaves when it fails, so the report says so beside the others."""
    return Row(section.name, section.title, "", None, None, "", note=f"failed: {error.splitlines()[0][:200]}")


def skipped_row(section: Section, cost_s: float, elapsed_s: float, left_s: float) -> Row:
    """The row of a section whose estimated ``cost_s`` no longer fits the budget: not run, and why."""
    note = (
        f"skipped: budget ({elapsed_s:.0f} s elapsed, {left_s:.0f} s left, the section needs about "
        f"{cost_s:.0f} s; run it alone with --only {section.name})"
    )
    return Row(section.name, section.title, "", None, None, "", note=note)


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(rows: Sequence[Row], context: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in context["versions"].items())
    kind = "smoke run (tiny sizes: checks the harness, not figures)" if context["smoke"] else "full run"
    lines = [
        "# GPU benchmark: our jobs beside plain PyTorch on the same GPU",
        "",
        f"`{context['command']}` on **{context['device']}** (driver {context['driver']}, "
        f"{context['cpu_count']} CPUs; {context['date']}): {kind}, {context['elapsed_s']:.0f} s of a "
        f"{context['budget_s']:.0f} s budget; {versions}. Ratio = ours / baseline (higher is better), "
        "on the terms beside it. Wall = the whole process, start-up and compilation included. See "
        "docs/performance.md (GPU figures) for the method.",
        "",
        "| figure | unit | ours | baseline | ratio | terms | MFU ours / baseline | peak GiB ours / baseline "
        "| wall s ours / baseline | baseline is |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
        lines.append(
            f"| {row.name} | {row.unit} | {_number(row.ours)} | {_number(row.baseline)} | {ratio} | {row.terms or '-'} "
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
    if context["skipped_sections"]:
        lines += ["", f"Skipped sections (budget): {', '.join(context['skipped_sections'])}."]
    if context["pending_sections"]:
        lines += [
            "",
            f"Partial results: written after each section; not run yet, or the run was stopped before them: "
            f"{', '.join(context['pending_sections'])}.",
        ]
    return "\n".join(lines) + "\n"


def write(rows: Sequence[Row], context: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``results-gpu.json`` and ``results-gpu.md`` in ``out``, each replaced whole (written beside,
    then renamed), so that a run stopped while writing leaves the previous section's complete files."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results-gpu.json", out / "results-gpu.md"
    document = {"context": context, "rows": [row.as_dict() for row in rows]}
    for path, text in ((json_path, json.dumps(document, indent=2) + "\n"), (md_path, markdown(rows, context))):
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(text)
        os.replace(partial, path)
    return json_path, md_path
