"""Figure 4: input pipeline images/s per CPU core, our ImageNet loader against torchvision defaults.

Both read the same generated JPEG tree with the same worker count and batch size and run to
the same output (a batch of ``size`` x ``size`` crops ready for the model's first layer: ours
leaves normalization to the device, as the job does, the baseline does it on the CPU, as
torchvision does). Timing starts once every worker has delivered a batch, so worker start-up
(forkserver for ours, fork for the baseline) is left out of both.

"Per core" is images over the CPU seconds that the loader's processes (main and workers)
spent in the timed window: on a shared machine, wall time also counts the neighbours' work,
CPU time counts only ours. Wall-clock images/s are kept beside it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch

from bench.cpu import tv_baseline
from bench.harness.results import Figure
from training.config.settings import parse_settings
from training.data.imagenet import load_imagenet, train_keys
from training.pytorch import image_loader

SEED = 0


@dataclass(frozen=True)
class Rate:
    images: int
    wall_s: float
    cpu_s: float

    @property
    def per_core(self) -> float:
        return self.images / self.cpu_s

    @property
    def wall(self) -> float:
        return self.images / self.wall_s


def _cpu_seconds() -> float:
    """CPU time of this process and its live children (the loader's workers)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker that exited meanwhile
            total += sum(child.cpu_times()[:2])
    return total


def _rate(batches: Iterable[object], total: int, batch_size: int, skip: int) -> Rate:
    """Rate over batches ``skip`` to ``total - 1``, sampled before the workers exit."""
    if total <= skip:
        raise ValueError(f"{total} batches are too few to time; use more images")
    wall = cpu = 0.0
    for i, _ in enumerate(batches):
        if i == skip - 1:
            wall, cpu = time.perf_counter(), _cpu_seconds()
        elif i == total - 1:
            return Rate((total - skip) * batch_size, time.perf_counter() - wall, _cpu_seconds() - cpu)
    raise ValueError(f"the loader gave fewer than {total} batches")


def ours_rate(root: Path, size: int, batch_size: int, workers: int) -> Rate:
    folder, _ = load_imagenet(root, size, SEED)
    steps = len(folder) // batch_size
    keys = train_keys(len(folder), 0, 1, batch_size, SEED, steps, 0, steps)
    # The job's loader as the job builds it for rank 0 of 1 with --data-workers ``workers``.
    settings = parse_settings("pytorch", ["--data-workers", str(workers)])
    rank0 = SimpleNamespace(rank=0, local_size=1)
    batches = image_loader(folder, keys, settings, rank0, torch.device("cpu"))  # type: ignore[arg-type]
    return _rate(batches, steps, batch_size, workers)


def baseline_rate(root: Path, size: int, batch_size: int, workers: int) -> Rate:
    loader = tv_baseline.loader(root / "train", size, batch_size, workers)
    return _rate(loader, len(loader.dataset) // batch_size, batch_size, workers)


def measure(root: Path, size: int, batch_size: int, workers: int, rounds: int, ours_root: Path | None = None) -> Figure:
    """Ours against torchvision's defaults on ``root``; with ``ours_root`` (a transcoded copy of
    ``root``), ours reads the copy and the baseline still reads the originals."""
    ours: list[Rate] = []
    base: list[Rate] = []
    for _ in range(rounds):  # interleaved: a burst of load hits one pair, not one side
        base.append(baseline_rate(root, size, batch_size, workers))
        ours.append(ours_rate(ours_root or root, size, batch_size, workers))
    key, source = ("pipeline", "500x375 JPEGs") if ours_root is None else ("pipeline_transcoded", "a copy transcoded")
    figure = Figure.from_rounds(
        key,
        f"Input pipeline, {size}px crops from {source}, {workers} workers",
        "images/s per core",
        [r.per_core for r in ours],
        [r.per_core for r in base],
        goal=2.0 if ours_root is None else 3.0,
        ours_label="training.data.imagenet" if ours_root is None else "training.data.imagenet on the copy",
        baseline_label="torchvision defaults",
    )
    figure.samples |= {"ours_wall_images_s": [r.wall for r in ours], "baseline_wall_images_s": [r.wall for r in base]}
    return figure
