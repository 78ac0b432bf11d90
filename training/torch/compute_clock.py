"""A PyTorch rank's compute time per step, for the slow-rank check (training/run/slow_ranks.py says what
it spans and why).

On the CPU each span is two ``time.perf_counter`` readings. On a GPU the host runs ahead of the device,
so its clock says when kernels were queued, not when they ran: each span is two CUDA events recorded on
the current stream, and their times are read only at a log step, where the loop has already waited for
the device (``elapsed_time`` of finished events costs no synchronisation). The events are reused from
window to window: no allocation per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from training.run.slow_ranks import Span

T = TypeVar("T")


class ComputeClock:
    """:class:`training.run.slow_ranks.ComputeTimes` for a PyTorch loop: :meth:`begin` as the step asks
    for its batch (:meth:`fetching` does it), :meth:`end` once its loss is computed."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._begin: Any = None  # a perf_counter reading, or a CUDA event
        self._spans: list[tuple[Any, Any]] = []
        self._spare: list[torch.cuda.Event] = []

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        if self._begin is not None and self._cuda:
            self._spare.append(self._begin)  # a begin without its end: no span
        self._begin = self._now()

    def end(self) -> None:
        if self._begin is None:
            return
        self._spans.append((self._begin, self._now()))
        self._begin = None

    def fetching(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, with :meth:`begin` called before each is asked for: the wait for data is the rank's own."""
        iterator = iter(batches)
        while True:
            self.begin()
            try:
                item = next(iterator)
            except StopIteration:
                return
            yield item

    def take_window(self) -> Span | None:
        spans, self._spans = self._spans, []
        if not spans:
            return None
        if not self._cuda:
            return sum(end - begin for begin, end in spans), len(spans)
        spans[-1][1].synchronize()  # done already at a log step: a check, not a wait
        total_ms = sum(begin.elapsed_time(end) for begin, end in spans)
        for begin, end in spans:
            self._spare += [begin, end]
        return total_ms / 1000.0, len(spans)
