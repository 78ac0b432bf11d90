"""``--decode auto``'s start-up probe: what it times, and the rule it applies on every rank."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from bench.harness.jpegs import write_imagenet_tree
from tests.training.test_gpu_decode import pillow_jpeg_decoder
from training import pytorch
from training.config.settings import parse_settings
from training.config.sync import HIERARCHICAL, LOCAL_SGD, SyncSettings
from training.data import decode_choice
from training.data import imagenet as data
from training.data.decode_choice import (
    HEADROOM,
    KEEPS_UP,
    Rates,
    batches_per_second,
    measure_rates,
    probe_batches,
    warm_batches,
)
from training.data.gpu_decode import GpuDecode
from training.torch.models import build_model
from training.torch.sync import PeriodicSync


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


def test_a_loader_is_timed_after_its_workers_first_round() -> None:
    """Workers that start one after the other: the first round's batches come late, then at a steady pace."""
    clock = Clock()
    workers = 4

    def staggered() -> Iterator[int]:
        for n in range(100):
            clock.now += 1.0 if n < workers else 0.25  # each worker's start-up, then its pace
            yield n

    steady = batches_per_second(staggered(), 8, lambda: None, clock, warm=warm_batches(workers))
    assert steady == pytest.approx(4.0)
    clock.now = 0.0
    assert batches_per_second(staggered(), 8, lambda: None, clock) < 0.75 * steady  # timed from the first batch


def test_each_loader_is_stopped_before_the_next_starts() -> None:
    clock, log = Clock(), []

    def loader(name: str, each: float) -> Any:
        def start() -> Iterator[int]:
            log.append(f"{name} started")
            return timed_batches(clock, 1.0, each, log, name)

        return start

    rates = measure_rates(loader("cpu", 0.5), loader("gpu", 0.25), loader("model", 0.2), 4, lambda: None, clock)
    assert log == [f"{name} {event}" for name in ("cpu", "gpu", "model") for event in ("started", "stopped")]
    assert (rates.cpu, rates.gpu, rates.model) == pytest.approx((2.0, 4.0, 5.0))
    assert rates.gpu_share() > 0


@pytest.mark.parametrize(
    ("cpu", "gpu", "share"),
    [
        (KEEPS_UP, 10.0, 0.0),  # the CPU loader keeps up with the model: the CPU decodes everything
        (2.0, 0.1, 0.0),
        # A compiled ResNet-50 on one H100 against eight workers and nvJPEG (rates in images/s / 1000):
        # together barely enough, so each loader at the same pace.
        (3.0 / 5.3, 2.8 / 5.3, round(2.8 / 5.8, 2)),
        (0.5, 0.5, 0.5),  # short by more than both together can give: the most input there is
        (0.5, 4.0, round(1 - 0.5 / KEEPS_UP + HEADROOM, 2)),  # a fast GPU path takes only what is needed
    ],
)
def test_the_gpu_takes_the_share_the_cpu_loader_cannot_carry(cpu: float, gpu: float, share: float) -> None:
    assert Rates(cpu=cpu, gpu=gpu, model=1.0).gpu_share() == pytest.approx(share)


def test_the_probe_covers_two_rounds_of_workers() -> None:
    assert [probe_batches(n) for n in (0, 1, 4, 15)] == [8, 8, 8, 30]


@pytest.fixture
def plan(tmp_path: Path) -> data.DataPlan:
    write_imagenet_tree(tmp_path, images=8, classes=2)
    folder = data.scan_split(tmp_path, "train", 16, seed=0)
    assert folder is not None
    return data.DataPlan(folder, None, 2, steps_per_epoch=2, total_steps=2)


def ranks_answering(*others: bool) -> SimpleNamespace:
    """Rank 0 of a DDP job whose other ranks' probes answered ``others``."""
    return SimpleNamespace(
        rank=0,
        size=1,
        local_size=1,
        allgather_object=lambda mine: [mine, *others],
        drop_gradients=pytorch.DDPBackend.drop_gradients.__get__(object()),
    )


# loaders in-process: quick
AUTO = parse_settings(
    "pytorch", ["--decode", "auto", "--data-workers", "0", "--batch-size", "4", "--seed", "0", "--image-size", "16"]
)
CPU = torch.device("cpu")


def tiny_model(
    plan: data.DataPlan,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda module: module,
    periodic: Callable[[torch.nn.Module], PeriodicSync] | None = None,
) -> pytorch.TrainedModel:
    """resnet_tiny as the job trains it in fp32 on the CPU: ``wrap``ped (by DDP), with ``periodic`` sync
    built on the wrapper."""
    module = build_model("resnet_tiny", plan.num_classes).train()
    wrapped = wrap(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return pytorch.TrainedModel(
        CPU, None, module, wrapped, optimizer, scaler, None if periodic is None else periodic(wrapped)
    )


def tiny_steps(plan: data.DataPlan, backend: SimpleNamespace) -> Callable[[], Iterator[None]]:
    return partial(pytorch.model_steps, AUTO, plan, backend, tiny_model(plan))


def test_the_model_probe_leaves_the_model_as_it_was(plan: data.DataPlan) -> None:
    model = tiny_model(plan)
    before = {name: value.clone() for name, value in model.module.state_dict().items()}
    steps = pytorch.model_steps(AUTO, plan, ranks_answering(), model)
    next(steps)
    next(steps)
    assert any(not torch.equal(before[name], value) for name, value in model.module.state_dict().items())  # BN
    steps.close()
    assert all(torch.equal(before[name], value) for name, value in model.module.state_dict().items())
    assert all(parameter.grad is None for parameter in model.module.parameters())
    assert model.optimizer.state_dict()["state"] == {}  # no step taken: no momentum


@pytest.fixture
def gloo_world(tmp_path: Path) -> Iterator[None]:
    """This process as the one rank of a gloo job, enough for DDP and torch's post-local-SGD hook."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.usefixtures("gloo_world")
@pytest.mark.parametrize("mode", [LOCAL_SGD, HIERARCHICAL])
def test_the_model_probe_leaves_the_sync_warm_up_to_the_training_steps(plan: data.DataPlan, mode: str) -> None:
    # Resumed after 1 of 3 synchronous steps: the hook's count of backward passes says when local steps start.
    settings = SyncSettings(mode=mode, every=2, warmup_steps=3)
    model = tiny_model(
        plan,
        wrap=lambda module: DistributedDataParallel(module.to(memory_format=torch.channels_last)),  # as the job
        periodic=lambda ddp: PeriodicSync(settings, ddp, local_size=1, start_step=1),
    )
    assert model.periodic is not None
    hook = model.periodic.hook_state
    steps = pytorch.model_steps(AUTO, plan, ranks_answering(), model)
    for _ in range(4):  # more passes than the warm-up has steps left
        next(steps)
        assert hook.iter == 1  # each pass allreduced over every rank, as the next training step will
    steps.close()
    assert hook.iter == 1
    assert all(parameter.grad is None for parameter in model.module.parameters())
    images, labels = data.synthetic_batch(0, 0, 4, 16, plan.num_classes)
    torch.nn.functional.cross_entropy(model.wrapped(torch.from_numpy(images)), torch.from_numpy(labels)).backward()
    assert hook.iter == 2  # a training step's backward still counts


@pytest.mark.parametrize(("mine", "others", "share"), [(0.0, [0.0], None), (0.0, [0.3], 0.3), (0.6, [0.3, 0.0], 0.6)])
def test_auto_gives_every_rank_the_largest_share_any_rank_needs(
    monkeypatch: pytest.MonkeyPatch, plan: data.DataPlan, mine: float, others: list[float], share: float | None
) -> None:
    monkeypatch.setattr(pytorch, "measure_rates", lambda *args, **kwargs: SimpleNamespace(gpu_share=lambda: mine))
    backend = ranks_answering(*others)
    chosen = pytorch.settle_auto(AUTO, plan, backend, CPU, GpuDecode(pillow_jpeg_decoder), tiny_steps(plan, backend))  # type: ignore[arg-type]
    if share is None:
        assert chosen is None
    else:
        assert chosen == GpuDecode(pillow_jpeg_decoder, share)


def test_the_probe_times_both_real_loaders(
    monkeypatch: pytest.MonkeyPatch, plan: data.DataPlan, caplog: pytest.LogCaptureFixture
) -> None:
    measured: list[Rates] = []

    def recording(*args: Any, **kwargs: Any) -> Rates:
        measured.append(decode_choice.measure_rates(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(pytorch, "measure_rates", recording)
    with caplog.at_level(logging.INFO, logger="training.pytorch"):
        backend = ranks_answering()
        pytorch.settle_auto(AUTO, plan, backend, CPU, GpuDecode(pillow_jpeg_decoder), tiny_steps(plan, backend))  # type: ignore[arg-type]
    assert len(measured) == 1 and min(measured[0].cpu, measured[0].gpu, measured[0].model) > 0
    assert f"--decode auto: {measured[0]}; decoding with" in caplog.text


@pytest.mark.parametrize("requested", ["cpu", "gpu"])
def test_only_auto_is_probed(monkeypatch: pytest.MonkeyPatch, plan: data.DataPlan, requested: str) -> None:
    monkeypatch.setattr(pytorch, "measure_rates", None)  # would fail if called
    settings = dataclasses.replace(AUTO, decode=requested)
    decode = GpuDecode(pillow_jpeg_decoder) if requested == "gpu" else None
    backend = ranks_answering()
    assert pytorch.settle_auto(settings, plan, backend, CPU, decode, tiny_steps(plan, backend)) is decode  # type: ignore[arg-type]
