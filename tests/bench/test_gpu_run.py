"""``python -m bench.gpu`` as a whole, without a GPU: the smoke run on the CPU (CI's form of ``make
bench-gpu-smoke``), the results written after each section (a run killed in its second section
keeps the first one's rows), and the budget: a section that no longer fits is skipped and both
files say so, and no measured process runs past the budget's end.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import run as gpu
from bench.gpu.report import Row, Scale, Section
from bench.harness import proc
from tests.training.jobs import REPO

FIRST = Row("first", "the first section's figure", "img/s", 2.0, 1.0, "a baseline", "the same terms")


def first_rows(work: Path, scale: Scale) -> list[Row]:
    return [FIRST]


def third_rows(work: Path, scale: Scale) -> list[Row]:
    return [replace(FIRST, section="third", name="the third section's figure")]


def killed(work: Path, scale: Scale) -> list[Row]:
    os.kill(os.getpid(), signal.SIGKILL)  # as a run stopped from outside: nothing after this line runs
    raise AssertionError("unreachable")


def never(work: Path, scale: Scale) -> list[Row]:
    raise AssertionError("a skipped section ran")


def read(out: Path) -> tuple[dict[str, Any], str]:
    return json.loads((out / "results-gpu.json").read_text()), (out / "results-gpu.md").read_text()


# The budget fits a GPU window (gpu.BUDGET_S); on a loaded 2-core machine the CPU smoke run's sections
# take several times their unloaded time, and a section given what is left of 330 s ran past it.
SMOKE_BUDGET_S = 1200


def test_the_smoke_run_passes_on_the_cpu_with_a_row_per_section(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--smoke", "--budget-s", str(SMOKE_BUDGET_S), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SMOKE_BUDGET_S + 120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    document, text = read(tmp_path)
    context = document["context"]
    assert (context["smoke"], context["device"], context["cpu_count"]) == (True, "cpu", os.cpu_count())
    assert context["driver"] and context["budget_s"] == SMOKE_BUDGET_S and context["versions"]["torch"]
    assert context["failed_sections"] == context["skipped_sections"] == context["pending_sections"] == []
    rows = document["rows"]
    assert [row["section"] for row in rows] == [section.name for section in gpu.SECTIONS]  # one row each here
    assert all(row["ours"] > 0 and row["baseline"] > 0 and row["terms"] for row in rows), rows
    assert "need CUDA" in rows[-1]["note"]  # the decode section ran --decode cpu only, and says why
    assert "smoke run" in text and all(f"| {row['name']} | {row['unit']} |" in text for row in rows)


def run_killed_in_second_section(out: str) -> None:
    """The process of the next test: ``bench.gpu --smoke`` with a first section that returns its rows
    and a second one that is killed while it runs."""
    gpu.SECTIONS = [Section("first", "First", first_rows, 1, 1), Section("second", "Second", killed, 1, 1)]
    gpu.main(["--smoke", "--out", out])


def test_a_run_killed_in_its_second_section_keeps_the_rows_of_the_first(tmp_path: Path) -> None:
    code = f"from tests.bench.test_gpu_run import run_killed_in_second_section as run; run({str(tmp_path)!r})"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
    document, text = read(tmp_path)
    assert [row["name"] for row in document["rows"]] == [FIRST.name]
    assert document["context"]["pending_sections"] == ["second"] and document["context"]["failed_sections"] == []
    assert "| the first section's figure | img/s | 2 | 1 | 2.000 | the same terms |" in text
    assert "Partial results" in text and "stopped before them: second." in text
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results-gpu.json", "results-gpu.md"]


def test_a_section_that_fails_after_a_row_keeps_that_row(tmp_path: Path) -> None:
    """As when gpt-1.3b ran past the budget after gpt-125m was measured: the measured row stays."""

    def one_then_fails(work: Path, scale: Scale) -> Iterator[Row]:
        yield FIRST
        raise proc.BenchError("the second pair ran past its limit")

    sections = [Section("first", "a section that fails half-way", one_then_fails, 1, 1)]
    outcome = gpu.run_sections(
        sections, tmp_path, Scale(smoke=True, cuda=False, deadline=math.inf), 0.0, lambda _: None
    )
    assert [row.name for row in outcome.rows] == [FIRST.name, "a section that fails half-way"]
    assert outcome.failed == ["first"] and "ran past its limit" in outcome.rows[1].note


def test_a_section_that_no_longer_fits_the_budget_is_skipped_and_both_files_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sections = [
        Section("first", "First", first_rows, 1, 1),
        Section("second", "Second", never, 1000, 1000),
        Section("third", "Third", third_rows, 1, 1),  # still fits after the skipped one
    ]
    monkeypatch.setattr(gpu, "SECTIONS", sections)
    assert gpu.main(["--smoke", "--budget-s", "60", "--out", str(tmp_path)]) == 0
    document, text = read(tmp_path)
    assert document["context"]["skipped_sections"] == ["second"] and document["context"]["budget_s"] == 60
    assert [row["section"] for row in document["rows"]] == ["first", "second", "third"]
    note = document["rows"][1]["note"]
    assert note.startswith("skipped: budget (") and "needs about 1000 s" in note and "--only second" in note
    assert f"- Second: {note}" in text
    assert "Skipped sections (budget): second." in text


def test_no_measured_process_runs_past_the_end_of_the_budget() -> None:
    scale = Scale(smoke=True, cuda=False, deadline=time.monotonic() + 2)
    started = time.monotonic()
    with pytest.raises(proc.BenchError, match=r"^ran past its limit of 2 s"):
        proc.run([sys.executable, "-c", "import time; time.sleep(120)"], proc.thread_env(1), scale.timeout(420))
    assert time.monotonic() - started < proc.STOP_GRACE_S


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--budget-s", "0"], "--budget-s: must be a number of seconds, at least 1, got 0"),
        (["--budget-s", "nan"], "--budget-s: must be a number of seconds, at least 1, got nan"),
        (["--out", "/proc/bench-gpu"], "--out /proc/bench-gpu: cannot make it"),
    ],
)
def test_bad_flags_are_one_error_line_and_exit_2_before_a_section_runs(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "SECTIONS", [Section("first", "never run", never, 1, 0)])
    with pytest.raises(SystemExit) as exited:
        gpu.main(["--smoke", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and said in err
