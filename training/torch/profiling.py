"""``--profile-dir``: torch.profiler over a few steps right after the timing warmup, from inside the job.

A profiler wrapped around the job from outside never prints: the job ends its process without
returning to the caller (training.run.job), so the profile is taken and written here, in the step
loop. Every rank writes a Chrome trace (``rank<N>.json``, open it in Perfetto or chrome://tracing);
rank 0 also logs the operators that took the most device time (CPU time without a GPU). The
profiled steps are slower than the others and fall in the measured window: a profiled run's
rates are not figures.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

log = logging.getLogger(__name__)

PROFILED_STEPS = 5
TOP_OPERATORS = 20


class StepProfiler:
    """Call :meth:`step` after every step of the run; nothing happens without a directory."""

    def __init__(self, directory: Path | None, rank: int, warmup_steps: int) -> None:
        self.directory, self.rank = directory, rank
        self.cuda = torch.cuda.is_available()
        self.written = False
        self._profile: profile | None = None
        if directory is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        # One step of the profiler's own warmup (it discards it), then the profiled steps.
        window = schedule(wait=max(warmup_steps - 1, 0), warmup=1, active=PROFILED_STEPS, repeat=1)
        self._profile = profile(activities=activities, schedule=window, on_trace_ready=self._write)
        self._profile.start()

    def step(self) -> None:
        if self._profile is not None:
            self._profile.step()

    def stop(self) -> None:
        """At the end of the run (a run shorter than the window writes nothing, and says so)."""
        if self._profile is None:
            return
        self._profile.stop()
        self._profile = None
        if not self.written and self.rank == 0:
            log.warning("--profile-dir: the run ended before %d steps after the timing warmup", PROFILED_STEPS)

    def _write(self, prof: profile) -> None:
        assert self.directory is not None
        path = self.directory / f"rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self.written = True
        if self.rank == 0:
            key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=TOP_OPERATORS)
            log.info("profile of up to %d steps after the timing warmup, in %s:\n%s", PROFILED_STEPS, path, table)
