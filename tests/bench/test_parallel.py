"""bench.cpu.parallel's figures from real torchrun runs, at the quick sizes: each beside its baseline."""

from __future__ import annotations

import pytest

from bench.cpu import parallel
from bench.harness.results import INFO, PASS


def test_fsdp_memory_per_rank_is_the_whole_model_over_n() -> None:
    figures = parallel.memory_figures(quick=True)
    assert [f.key for f in figures] == [f"fsdp_memory_{n}" for n in parallel.MEMORY_WORLDS]
    for world, figure in zip(parallel.MEMORY_WORLDS, figures, strict=True):
        assert figure.baseline == pytest.approx(figures[0].baseline)  # one process, whole model, both times
        assert figure.ratio == pytest.approx(figure.baseline / figure.ours)
        assert figure.ratio > 0.9 * world and figure.status == PASS, figure


def test_fsdp_is_timed_against_ddp_on_the_same_model() -> None:
    figure = parallel.fsdp_vs_ddp(rounds=1, quick=True)
    assert figure.ours > 0 and figure.baseline > 0 and figure.status == INFO
    assert figure.ratio == pytest.approx(figure.ours / figure.baseline)
