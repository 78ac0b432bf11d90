"""``--decode auto``: the GPU path only where the CPU loader holds the model back and the GPU path does not.

At start, with nvJPEG working, the job times three things over the run's own first batches, one
after the other: the DataLoader workers decoding on the CPU; the workers reading files while this
process decodes on the GPU (on its side streams, as in training); and the model's forward and
backward passes on a synthetic batch (no optimizer step; the gradients, batch-norm statistics and the
periodic sync's warm-up count are put back). The GPU path is kept only if, on every rank, the CPU
loader was slower than ``KEEPS_UP`` times the model's rate (so it would hold the step back) and the
GPU path at least ``MARGIN`` times as fast as the CPU loader. Each rate is measured alone: the GPU
path's decode, crops and resizes share the GPU with the step in training, which
``bench.gpu_decode_e2e`` measures end to end. On the one H100 on record (4 host cores,
docs/performance.md), nvJPEG's decode, crop and resize alone ran at 2,782 images/s and the CPU
loader fed training at 3,795 images/s: there ``auto`` would decode on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The GPU path must beat the CPU loader by this much: the probe is short, and the GPU path also
# costs the model GPU time that the probe does not see.
MARGIN = 1.1
# The CPU loader keeps up when it makes batches this much faster than the model uses them alone:
# in training it also shares the host with the training process.
KEEPS_UP = 1.05
MIN_PROBE_BATCHES = 8


@dataclass(frozen=True)
class Rates:
    """Batches per second of each loader, and of the model's forward and backward passes."""

    cpu: float
    gpu: float
    model: float

    def gpu_pays(self) -> bool:
        return self.cpu < KEEPS_UP * self.model and self.gpu >= MARGIN * self.cpu

    def __str__(self) -> str:
        return f"CPU loader {self.cpu:.2f}, GPU path {self.gpu:.2f}, model {self.model:.2f} batches/s"


def probe_batches(workers: int) -> int:
    """Batches each loader is timed over: two rounds of the workers, whose first batches all arrive
    together (they start together), so the rate covers each worker's steady pace."""
    return max(MIN_PROBE_BATCHES, 2 * workers)


def batches_per_second(
    batches: Iterator[Any], count: int, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter
) -> float:
    """The rate of ``count`` batches after the first, which pays for starting the workers."""
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
) -> Rates:
    """Each in turn (one at a time: the loaders share the host's cores, the GPU path and the model the
    GPU), each dropped, which stops its workers or puts the model back, before the next starts."""
    return Rates(*(batches_per_second(make(), count, sync, clock) for make in (cpu, gpu, model)))
