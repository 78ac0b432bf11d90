"""``--decode auto``: how much of the JPEG decoding the GPU takes, from rates measured at start.

With nvJPEG working, the job times three things over the run's own first batches, one after the
other, each after a warm-up: the DataLoader workers decoding on the CPU; the workers reading files
while the batch thread decodes on the GPU (on its side streams, as in training); and the model's
forward and backward passes on a synthetic batch (no optimizer step; the gradients, batch-norm
statistics and the periodic sync's warm-up count are put back). Where the CPU loader keeps up with
the model, the CPU decodes everything. Where it does not, the two decoders split the images
(training/data/gpu_decode.py ``gpu_decodes``): the GPU takes what the CPU loader cannot carry, plus
``HEADROOM``, but never more than the share at which both loaders run at one pace (which gives the
most images per second of the two together). The GPU's share is kept that small because its
decode, crops and resizes take GPU time from the step: on one H100 with 16 cores, eight workers fed
a compiled ResNet-50 at 0.99 of its synthetic rate, nvJPEG alone at 0.65 (docs/performance.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The CPU loader keeps up when it makes batches this much faster than the model uses them alone:
# in training it also shares the host with the training process.
KEEPS_UP = 1.05
# The GPU's share is this much above what the CPU loader cannot carry: the probe is short.
HEADROOM = 0.1
MIN_PROBE_BATCHES = 8


@dataclass(frozen=True)
class Rates:
    """Batches per second of each loader, and of the model's forward and backward passes."""

    cpu: float
    gpu: float
    model: float

    def gpu_share(self) -> float:
        """The share of the images the GPU decodes: 0 where the CPU loader keeps up (see the module)."""
        short = 1 - self.cpu / (KEEPS_UP * self.model)
        if short <= 0:
            return 0.0
        balanced = self.gpu / (self.cpu + self.gpu)
        return round(min(short + HEADROOM, balanced), 2)

    def __str__(self) -> str:
        return f"CPU loader {self.cpu:.2f}, GPU path {self.gpu:.2f}, model {self.model:.2f} batches/s"


def probe_batches(workers: int) -> int:
    """Batches each loader is timed over: two rounds of the workers, so the rate covers each worker's
    steady pace."""
    return max(MIN_PROBE_BATCHES, 2 * workers)


def warm_batches(workers: int) -> int:
    """Batches a loader makes before it is timed: its workers' first round. They start together but
    not at once (each imports torch and unpickles the dataset in a process of its own), and timing
    from the first batch alone read a loader that fed a compiled ResNet-50 at 5,520 img/s on one
    H100 as less than half as fast."""
    return max(1, workers)


def batches_per_second(
    batches: Iterator[Any],
    count: int,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    warm: int = 1,
) -> float:
    """The rate of ``count`` batches after the first ``warm``, which pay for starting the workers (or
    for compiling the model)."""
    for _ in range(warm):
        next(batches)
    sync()
    start = clock()
    for _ in range(count):
        next(batches)
    sync()  # the device work of the last batch counts too
    return count / (clock() - start)


def measure_rates(
    cpu: Callable[[], Iterator[Any]],
    gpu: Callable[[], Iterator[Any]],
    model: Callable[[], Iterator[Any]],
    count: int,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    warm: int = 1,
) -> Rates:
    """Each in turn (one at a time: the loaders share the host's cores, the GPU path and the model the
    GPU), each dropped, which stops its workers or puts the model back, before the next starts. The
    loaders are timed after ``warm`` batches, the model after its first pass."""
    loaders = [batches_per_second(make(), count, sync, clock, warm) for make in (cpu, gpu)]
    return Rates(*loaders, batches_per_second(model(), count, sync, clock))
