"""The communication-efficiency figure from real 2-rank runs (quick sizes): the same ranks with the
gradient allreduce against without it, in wall time and CPU time."""

from __future__ import annotations

import re

import pytest

from bench.cpu import comm
from bench.harness import steps

TINY = steps.Shape(model="resnet_tiny", image_size=32, batch=8, steps=4, warmup=1, num_classes=10)


@pytest.mark.parametrize("launcher", sorted(comm.LAUNCHERS))
def test_the_same_ranks_are_timed_with_and_without_the_allreduce(launcher: str) -> None:
    figure = comm.measure(TINY, rounds=1, launcher=launcher, bus_gbps=None)
    assert figure.key == f"comm_efficiency_{launcher}"
    assert figure.ours > 0 and figure.baseline > 0
    assert figure.ratio == pytest.approx(figure.ours / figure.baseline)
    cpu_ratio = figure.samples["ours_images_per_cpu_s"][0] / figure.samples["baseline_images_per_cpu_s"][0]
    match = re.fullmatch(r"in CPU time: (\d\.\d\d)", figure.note)
    assert match and float(match[1]) == pytest.approx(cpu_ratio, abs=0.005)


def test_a_rank_count_other_than_two_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm.proc, "run_json", lambda *args, **kwargs: {"world_size": 1})
    with pytest.raises(comm.proc.BenchError, match="expected 2 ranks"):
        comm.run(TINY, "ddp", "on")
