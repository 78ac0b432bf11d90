"""Ratios, goals and the table: the parts of the harness that decide PASS or BELOW."""

from __future__ import annotations

import json

import pytest

from bench.harness.results import BELOW, INFO, PASS, SKIPPED, Figure, markdown_table, paired_ratio, to_json


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    # A burst of load in round 2 slows the baseline only: the pair ratio there is an outlier.
    assert paired_ratio([10, 10, 10], [10, 5, 10]) == pytest.approx(1.0)
    assert paired_ratio([2, 4], [1, 1]) == pytest.approx(3.0)


@pytest.mark.parametrize(("ours", "baseline"), [([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0])])
def test_paired_ratio_rejects_bad_rounds(ours: list[float], baseline: list[float]) -> None:
    with pytest.raises(ValueError):
        paired_ratio(ours, baseline)


def test_status_follows_the_goal() -> None:
    assert Figure.from_rounds("a", "A", "x", [97.0], [100.0], goal=0.97).status == PASS
    assert Figure.from_rounds("a", "A", "x", [96.9], [100.0], goal=0.97).status == BELOW
    assert Figure.from_rounds("a", "A", "x", [1.0], [2.0]).status == INFO
    assert Figure.skipped("a", "A", "no Azurite").status == SKIPPED


def test_from_rounds_keeps_medians_and_raw_samples() -> None:
    fig = Figure.from_rounds("k", "t", "img/s", [3.0, 1.0, 2.0], [1.0, 1.0, 1.0], goal=2.0)
    assert (fig.ours, fig.baseline, fig.ratio) == (2.0, 1.0, 2.0)
    assert fig.samples == {"ours": [3.0, 1.0, 2.0], "baseline": [1.0, 1.0, 1.0]}


def test_table_shows_both_sides_ratio_goal_and_status() -> None:
    figures = [
        Figure.from_rounds("p", "Pipeline", "images/s per core", [500.0], [200.0], goal=2.0),
        Figure.from_rounds("s", "Scaling", "images/s", [80.0], [100.0], goal=0.85),
        Figure.skipped("z", "Staging", "Azurite missing"),
    ]
    rows = markdown_table(figures).splitlines()
    assert rows[0].startswith("| # | figure | ours | baseline |")
    assert "| 500 (ours) | 200 (baseline) | images/s per core | 2.500 | >= 2 | PASS |" in rows[2]
    assert rows[3].endswith("| 0.800 | >= 0.85 | BELOW |")
    assert "SKIPPED: Azurite missing" in rows[4]


def test_json_carries_status_and_context() -> None:
    data = json.loads(to_json([Figure.from_rounds("a", "A", "x", [1.0], [1.0], goal=1.0)], {"cpus": 2}, {"m": 1}))
    assert data["context"] == {"cpus": 2}
    assert data["figures"][0]["status"] == PASS
    assert data["m"] == 1
