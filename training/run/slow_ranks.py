"""Slow ranks, named while the job runs: each rank's compute time per step, compared across the ranks.

Under synchronous data parallelism every rank's wall step time is the same: the fast ranks wait for the
slowest in the gradient all-reduce. So each rank measures its own **compute**: from asking for a step's
batch until the step's loss is computed (data, the copy to the device, forward and loss). No collective
waits inside that span: DDP waits at the end of backward, Horovod in ``optimizer.synchronize()`` and in
the TensorFlow jobs' reduced gradients. The jobs' clocks (:class:`ComputeTimes`) are host timers on the
CPU, CUDA events on a GPU and ``tf.timestamp`` in TensorFlow's graphs; none waits for the device before
a log step, where the host waits anyway.

At each log step each rank's compute since the last one (seconds and steps) travels with the loss in the
one small all-gather the loop already makes (:class:`training.run.loop.TrainingRun`). Rank 0 keeps the
last ``WINDOW_S`` seconds of them and, at every log step once it has that much, decides (:func:`judge`)
on each rank's mean compute over that window: a rank is slow when it has stayed above ``SLOW_FACTOR``
times the median of the others' (of its peers: ranks that do the same work) for ``SLOW_FOR_S`` (or above
``CLEAR_FACTOR`` times for ``CLEAR_FOR_S``: far outside the noise, less patience is needed), and
recovered after as long at or under ``SLOW_FACTOR``. The window's length averages out the scheduling
noise of short steps; the time it must stay above keeps a noisy stretch from naming a rank, or from
taking the name back. A window slides with the log steps, so the name comes as soon as the evidence is
in, whatever the log cadence. Why these numbers, from the noise measured on the loaded local cluster:
docs/operator.md, "Slow ranks".

Rank 0 logs one ``[slow rank]`` line when a rank starts being slow and one when it recovers, and
rewrites ``--slow-ranks-json`` (temp file + rename) with the ranks that are slow now; `dtrain jobs` and
`dtrain status` read that file from the run directory. It is emptied when the run starts, so a requeued
attempt does not inherit the last attempt's verdict.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from training.run.outputs import output_error

log = logging.getLogger(__name__)

WINDOW_S = 10.0  # each rank's mean compute over the log steps of the last this many seconds (rank 0's clock)
SLOW_FACTOR = 1.5  # a window's mean above this times the median of the peers' ...
SLOW_FOR_S = 20.0  # ... in every window for this long (30 s of steps in all) is slow; as long at or under, recovered
CLEAR_FACTOR = 3.0  # far outside the noise (never seen in a window of the loaded local cluster) ...
CLEAR_FOR_S = 10.0  # ... for this long (20 s of steps) is enough
# A rank must also lose this much a step: under it the difference is timer and scheduling noise of
# steps too short to matter (a tiny model on a CPU), not a node worth draining.
MIN_EXCESS_S = 0.002
MARK = "[slow rank]"  # what begins rank 0's log lines about slow ranks (tests and operators grep it)

Span = tuple[float, int]  # compute seconds, summed over this many steps


class ComputeTimes(Protocol):
    """A job's clock of its own compute per step (the module's docstring says what it spans)."""

    def take_window(self) -> Span | None:
        """The compute of the steps since the last call, then forget them; None when no step was timed.
        Called at log steps only, after the host has waited for the device."""
        ...


class HostComputeTimes:
    """:class:`ComputeTimes` from host timestamps: each step's ``(begin, end)`` in seconds, or anything
    ``float()`` reads as seconds (TensorFlow's ``tf.timestamp`` tensors), read only at a log step."""

    def __init__(self) -> None:
        self._spans: list[tuple[Any, Any]] = []

    def add(self, begin: Any, end: Any) -> None:
        self._spans.append((begin, end))

    def take_window(self) -> Span | None:
        spans, self._spans = self._spans, []
        if not spans:
            return None
        return sum(float(end) - float(begin) for begin, end in spans), len(spans)


@dataclass(frozen=True)
class Standing:
    """What rank 0 knows of one rank after a judgement."""

    compute_s: float | None = None  # its mean compute per step in the last window that had one
    median_s: float | None = None  # the median of its peers' figures in that window
    above_since: float | None = None  # when its windows went above SLOW_FACTOR x the median (rank 0's clock)
    clear_since: float | None = None  # when they went above CLEAR_FACTOR x, if they still are
    under_since: float | None = None  # while slow: when they went back at or under SLOW_FACTOR x
    slow: bool = False
    since_step: int | None = None  # the log step at above_since
    since: str | None = None  # its time (ISO 8601, UTC)

    @property
    def ratio(self) -> float | None:
        if self.compute_s is None or not self.median_s:
            return None
        return self.compute_s / self.median_s


def judge(
    standings: Mapping[int, Standing],
    figures: Sequence[float | None],
    now_s: float,
    step: int,
    when: str,
    peers: Sequence[object] | None = None,
) -> dict[int, Standing]:
    """Every rank's standing after one judgement of the window ending at ``now_s`` (seconds on any monotonic
    clock) and log step ``step`` (``when``: its ISO time). Pure: the caller keeps the result for the next.

    ``figures``: each rank's mean compute seconds per step in the window, None for a rank that timed no
    step (its standing stays as it was). ``peers``: a key per rank; ranks are compared only with ranks of
    the same key (None: all with all). A rank whose peers have no figure is not judged this time.
    """
    keys = list(peers) if peers is not None else [None] * len(figures)
    judged = dict(standings)
    for rank, figure in enumerate(figures):
        before = standings.get(rank, Standing())
        others = [f for r, f in enumerate(figures) if r != rank and f is not None and keys[r] == keys[rank]]
        if figure is None or not others:
            continue
        median = statistics.median(others)
        judged[rank] = _next(before, figure, median, now_s, step, when)
    return judged


def _next(before: Standing, figure: float, median: float, now_s: float, step: int, when: str) -> Standing:
    above = figure > SLOW_FACTOR * median and figure - median >= MIN_EXCESS_S
    clear = above and figure > CLEAR_FACTOR * median
    standing = replace(before, compute_s=figure, median_s=median)
    if above:
        going_on = before.above_since is not None or before.slow  # a slow rank keeps the time it was first seen
        since = (before.above_since, before.since_step, before.since) if going_on else (now_s, step, when)
        standing = replace(
            standing,
            above_since=since[0],
            since_step=since[1],
            since=since[2],
            clear_since=(before.clear_since if before.clear_since is not None else now_s) if clear else None,
            under_since=None,
        )
        assert standing.above_since is not None
        lasted, clear_lasted = now_s - standing.above_since, now_s - (standing.clear_since or now_s)
        if lasted >= SLOW_FOR_S or (standing.clear_since is not None and clear_lasted >= CLEAR_FOR_S):
            standing = replace(standing, slow=True)
        return standing
    if before.slow:
        under_since = before.under_since if before.under_since is not None else now_s
        if now_s - under_since >= SLOW_FOR_S:
            return replace(standing, slow=False, under_since=None, above_since=None, since_step=None, since=None)
        return replace(standing, under_since=under_since, clear_since=None)
    return replace(standing, above_since=None, clear_since=None, since_step=None, since=None)


def seconds(value: float) -> str:
    return f"{value:.3g} s"


def slow_line(rank: int, host: str, standing: Standing, now_s: float) -> str:
    """`[slow rank] rank 1 on node-1: compute 0.52 s/step, 1.7x the median 0.31 s (for 21 s)`"""
    assert standing.compute_s is not None and standing.median_s is not None and standing.ratio is not None
    lasted = now_s - (standing.above_since if standing.above_since is not None else now_s)
    return (
        f"{MARK} rank {rank} on {host}: compute {seconds(standing.compute_s)}/step, "
        f"{standing.ratio:.1f}x the median {seconds(standing.median_s)} (for {lasted:.0f} s)"
    )


def recovered_line(rank: int, host: str, standing: Standing, since_step: int | None) -> str:
    assert standing.compute_s is not None and standing.median_s is not None and standing.ratio is not None
    return (
        f"{MARK} rank {rank} on {host} recovered: compute {seconds(standing.compute_s)}/step, "
        f"{standing.ratio:.1f}x the median {seconds(standing.median_s)} (slow since step {since_step})"
    )


def hostname() -> str:
    """This rank's node as Slurm names it (the short host name: `dtrain drain` takes it)."""
    return socket.gethostname().split(".", 1)[0]


class SlowRankWatch:
    """Rank 0's side: keep the last window of log steps, judge it at each, log the changes and keep
    ``path`` (``--slow-ranks-json``) current.

    ``peers``: a key per rank for :func:`judge` (None: every rank does the same work); ``why_not``: why
    this run cannot compare its ranks (logged once at the start, and nothing is judged).
    """

    def __init__(
        self,
        path: Path | None,
        peers: Sequence[object] | None = None,
        why_not: str | None = None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.peers = peers
        self.why_not = why_not
        self.window_s = window_s
        self._clock = clock
        self.standings: dict[int, Standing] = {}
        self._hosts: list[str] = []
        self._recent: deque[tuple[float, Sequence[Span | None]]] = deque()  # (time, each rank's spans) per log step
        self._began: float | None = None  # the first window begins with the first timed step (after the warmup)
        if why_not:
            log.info("%s not checked: %s", MARK, why_not)
        self._write(None)  # an earlier attempt's verdict (a requeued job) is not this one's

    def observe(self, step: int, spans: Sequence[Span | None], hosts: Sequence[str]) -> None:
        """One log step's spans (each rank's compute since the last) and the ranks' hosts, in rank order."""
        if self.why_not:
            return
        now = self._clock()
        self._hosts = list(hosts)
        if self._began is None:
            if all(span is None for span in spans):
                return
            self._began = now
        self._recent.append((now, spans))
        # each entry's spans end at its time and begin at the one before's: keep the fewest newest entries
        # that still cover window_s (the time since the end of the oldest entry dropped)
        while len(self._recent) > 1 and now - self._recent[0][0] >= self.window_s:
            self._recent.popleft()
        if now - self._began < self.window_s:
            return
        self.judge_window(step, now, self.figures(len(spans)))

    def figures(self, ranks: int) -> list[float | None]:
        """Each rank's mean compute per step over the window (None: no timed step in it)."""
        totals = [(0.0, 0)] * ranks
        for _, spans in self._recent:
            for rank, span in enumerate(spans):
                if span is not None:
                    totals[rank] = (totals[rank][0] + span[0], totals[rank][1] + span[1])
        return [total / steps if steps else None for total, steps in totals]

    def judge_window(self, step: int, now_s: float, figures: Sequence[float | None]) -> None:
        log.debug(
            "%s compute per rank up to step %d: %s", MARK, step, ", ".join(f"{f:.4f}" if f else "-" for f in figures)
        )
        when = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        before = self.standings
        self.standings = judge(before, figures, now_s, step, when, self.peers)
        changed = False
        for rank, standing in sorted(self.standings.items()):
            was = before.get(rank, Standing())
            if standing.slow and not was.slow:
                log.warning("%s", slow_line(rank, self._hosts[rank], standing, now_s))
                changed = True
            elif was.slow and not standing.slow:
                log.info("%s", recovered_line(rank, self._hosts[rank], standing, was.since_step))
                changed = True
        if changed:
            self._write(step)

    def document(self, step: int | None) -> dict[str, object]:
        slow = [
            {
                "rank": rank,
                "host": self._hosts[rank],
                "compute_s": s.compute_s,
                "median_s": s.median_s,
                "ratio": round(s.ratio or 0.0, 3),
                "since": s.since,
                "since_step": s.since_step,
            }
            for rank, s in sorted(self.standings.items())
            if s.slow
        ]
        rule = {"window_s": self.window_s, "factor": SLOW_FACTOR, "for_s": SLOW_FOR_S}
        rule |= {"clear_factor": CLEAR_FACTOR, "clear_for_s": CLEAR_FOR_S}
        return {"step": step, **rule, "slow": slow}

    def _write(self, step: int | None) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.document(step), indent=2) + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            # the verdict is a report: a full disk costs the file, never the run (the log has the line)
            log.warning("%s", output_error("--slow-ranks-json", self.path, exc))
