"""``--decode auto``'s start-up probe: what it times, and the rule it applies on every rank."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.jpegs import write_imagenet_tree
from tests.training.test_gpu_decode import pillow_jpeg_decoder
from training import data, decode_choice, pytorch
from training.decode_choice import MARGIN, Rates, batches_per_second, measure_rates, probe_batches


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_batches(clock: Clock, first: float, each: float, log: list[str], name: str) -> Iterator[int]:
    """Batches that take ``first`` seconds to the first (worker start-up), then ``each``."""
    try:
        clock.now += first
        yield 0
        for n in range(1, 1000):
            clock.now += each
            yield n
    finally:
        log.append(f"{name} stopped")


def test_the_rate_leaves_out_the_first_batch_and_counts_the_device_work_of_the_last() -> None:
    clock, syncs, log = Clock(), [], []

    def sync() -> None:
        syncs.append(clock.now)
        clock.now += 0.5  # the device finishing the queued work

    rate = batches_per_second(timed_batches(clock, 30.0, 0.25, log, "loader"), 8, sync, clock)
    assert rate == pytest.approx(8 / (8 * 0.25 + 0.5))
    assert syncs == [30.0, 30.5 + 8 * 0.25]


def test_each_loader_is_stopped_before_the_next_starts() -> None:
    clock, log = Clock(), []

    def loader(name: str, each: float) -> Any:
        def start() -> Iterator[int]:
            log.append(f"{name} started")
            return timed_batches(clock, 1.0, each, log, name)

        return start

    rates = measure_rates(loader("cpu", 0.5), loader("gpu", 0.25), 4, lambda: None, clock)
    assert log == ["cpu started", "cpu stopped", "gpu started", "gpu stopped"]
    assert (rates.cpu, rates.gpu) == (2.0, 4.0) and rates.gpu_pays()


@pytest.mark.parametrize(("gpu", "pays"), [(1.0, False), (MARGIN * 0.99, False), (MARGIN, True)])
def test_the_gpu_path_must_beat_the_cpu_loader_by_the_margin(gpu: float, pays: bool) -> None:
    assert Rates(cpu=1.0, gpu=gpu).gpu_pays() is pays


def test_the_probe_covers_two_rounds_of_workers() -> None:
    assert [probe_batches(n) for n in (0, 1, 4, 15)] == [8, 8, 8, 30]


@pytest.fixture
def plan(tmp_path: Path) -> data.DataPlan:
    write_imagenet_tree(tmp_path, images=8, classes=2)
    folder = data.scan_split(tmp_path, "train", 16, seed=0)
    assert folder is not None
    return data.DataPlan(folder, None, 2, steps_per_epoch=2)


def ranks_answering(*others: bool) -> SimpleNamespace:
    """Rank 0 of a job whose other ranks' probes answered ``others``."""
    return SimpleNamespace(rank=0, size=1, local_size=1, allgather_object=lambda mine: [mine, *others])


AUTO = argparse.Namespace(decode="auto", data_workers=1, batch_size=4, seed=0)


@pytest.mark.parametrize(("this_rank", "other_rank", "kept"), [(True, True, True), (True, False, False)])
def test_auto_keeps_the_gpu_only_where_every_rank_found_it_faster(
    monkeypatch: pytest.MonkeyPatch, plan: data.DataPlan, this_rank: bool, other_rank: bool, kept: bool
) -> None:
    rates = Rates(cpu=1.0, gpu=2.0 if this_rank else 1.0)
    monkeypatch.setattr(pytorch, "measure_rates", lambda *args: rates)
    chosen = pytorch.settle_auto(
        AUTO, plan, ranks_answering(other_rank), pytorch.torch.device("cpu"), pillow_jpeg_decoder
    )  # type: ignore[arg-type]
    assert (chosen is pillow_jpeg_decoder) is kept


def test_the_probe_times_both_real_loaders(
    monkeypatch: pytest.MonkeyPatch, plan: data.DataPlan, caplog: pytest.LogCaptureFixture
) -> None:
    measured: list[Rates] = []

    def recording(*args: Any) -> Rates:
        measured.append(decode_choice.measure_rates(*args))
        return measured[-1]

    monkeypatch.setattr(pytorch, "measure_rates", recording)
    with caplog.at_level(logging.INFO, logger="training.pytorch"):
        pytorch.settle_auto(AUTO, plan, ranks_answering(), pytorch.torch.device("cpu"), pillow_jpeg_decoder)  # type: ignore[arg-type]
    assert len(measured) == 1 and measured[0].cpu > 0 and measured[0].gpu > 0
    assert f"--decode auto: {measured[0]}; decoding on the" in caplog.text


@pytest.mark.parametrize("requested", ["cpu", "gpu"])
def test_only_auto_is_probed(monkeypatch: pytest.MonkeyPatch, plan: data.DataPlan, requested: str) -> None:
    monkeypatch.setattr(pytorch, "measure_rates", None)  # would fail if called
    args = argparse.Namespace(**{**vars(AUTO), "decode": requested})
    decode = pillow_jpeg_decoder if requested == "gpu" else None
    assert pytorch.settle_auto(args, plan, ranks_answering(), pytorch.torch.device("cpu"), decode) is decode  # type: ignore[arg-type]
