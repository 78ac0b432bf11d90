"""bench.cpu.local_sgd's verdicts from given evaluations: the target, the time to it, the ratio and its goal.

(The runs themselves need root, a local cluster and minutes: `python -m bench.cpu.local_sgd`.)
"""

from __future__ import annotations

import pytest

from bench.cpu import local_sgd
from bench.cpu.local_sgd import EVERY_STEP, FULL_SPEED, PERIODIC, SLOW, Shape
from bench.harness.results import BELOW, PASS, SKIPPED

SYNC = [[0, 0.0, 3.5], [8, 4.0, 3.2], [16, 8.0, 3.0]]  # every-step: its final loss 3.0 is the target


def test_time_to_target_is_the_first_evaluation_at_or_below_it() -> None:
    evals = [[0, 0.0, 3.5], [8, 1.0, 3.1], [16, 2.0, 3.0], [24, 3.0, 2.9]]
    assert local_sgd.time_to_target(evals, 3.0) == 2.0
    assert local_sgd.time_to_target(evals, 3.05) == 2.0
    assert local_sgd.time_to_target(evals, 2.0) is None


def runs(periodic: list[list[float]]) -> dict[str, dict[str, list[list[float]]]]:
    return {rate: {EVERY_STEP: SYNC, **dict.fromkeys(PERIODIC, periodic)} for rate in (FULL_SPEED, SLOW)}


def test_ratio_is_synchronous_time_over_periodic_time_against_each_rates_goal() -> None:
    # Reaches 3.0 after 24 steps in 6 s: 8 s / 6 s = 1.33, above 0.95 (full speed), below 1/0.6 (100 Mbit/s).
    figures = local_sgd.figures(runs([[0, 0.0, 3.5], [8, 2.0, 3.3], [16, 4.0, 3.1], [24, 6.0, 2.99]]), Shape())
    assert len(figures) == 2 * len(PERIODIC)
    by_key = {f.key: f for f in figures}
    full = by_key["local_sgd_local_sgd_full"]
    assert (full.ours, full.baseline, full.ratio) == (6.0, 8.0, pytest.approx(8 / 6))
    assert full.status == PASS and full.ours_label == "local-sgd, 24 steps"
    assert by_key["local_sgd_hierarchical_nesterov_100mbit"].status == BELOW
    assert by_key["local_sgd_hierarchical_nesterov_100mbit"].goal == pytest.approx(1 / 0.6)


def test_a_mode_that_never_reaches_the_target_is_reported_not_timed() -> None:
    figures = local_sgd.figures(runs([[0, 0.0, 3.5], [8, 1.0, 3.4], [16, 2.0, 3.2]]), Shape())
    assert {f.status for f in figures} == {SKIPPED}
    assert "local-sgd did not reach 3.000 in 16 steps" in figures[0].skipped_reason
