"""``--decode auto``: the GPU path only where it makes batches faster than the CPU loader on this node.

At start, with nvJPEG working, the job times both loaders over the run's own first batches: the
DataLoader workers decoding on the CPU, and the workers reading files while this process decodes
on the GPU (on its side streams, as in training). The GPU path is kept only if it was at least
``MARGIN`` times as fast on every rank. The probe measures the loaders, not the model: where the
CPU loader already outruns the model, a faster GPU path is still chosen and costs the model the GPU
time of its crops and resizes; ``bench.gpu_decode_e2e`` measures ``auto`` against ``cpu`` end to end
to show what that costs. On the one H100 on record (4 host cores, docs/performance.md), nvJPEG's
decode, crop and resize alone ran at 2,782 images/s and the CPU loader fed training at 3,795: there
``auto`` would decode on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The GPU path must beat the CPU loader by this much: the probe is short, and the GPU path also
# costs the model GPU time that the probe does not see.
MARGIN = 1.1
MIN_PROBE_BATCHES = 8


@dataclass(frozen=True)
class Rates:
    """Batches per second of each loader over the same batches."""

    cpu: float
    gpu: float

    def gpu_pays(self) -> bool:
        return self.gpu >= MARGIN * self.cpu

    def __str__(self) -> str:
        return f"CPU loader {self.cpu:.2f} batches/s, GPU path {self.gpu:.2f} batches/s"


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
    count: int,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
) -> Rates:
    """Each loader in turn (one at a time: they share the host's cores), each dropped, which stops
    its workers, before the next starts."""
    rates = [batches_per_second(make(), count, sync, clock) for make in (cpu, gpu)]
    return Rates(*rates)
