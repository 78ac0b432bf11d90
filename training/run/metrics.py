"""Throughput measurement and the metrics JSON (the schema is the same for every job)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

METRIC_KEYS = (
    "framework",
    "backend",
    "world_size",
    "batch_size_per_worker",
    "global_batch_size",
    "steps",
    "epochs",
    "warmup_steps_excluded",
    "images_per_sec",
    "images_per_sec_per_worker",
    "final_loss",
    "val_top1",
    "resumed_from_step",
    "precision",
    "device",
    "decoder",
    "skipped_images",
)


class StepTimer:
    """Wall time of one rank's measured steps, excluding checkpoint and evaluation pauses.

    The caller synchronizes the device, then calls :meth:`step_done` after every step. The
    first ``excluded`` steps pay for compilation, autotuning and allocator warmup and are
    not measured.
    """

    def __init__(self, excluded: int) -> None:
        self.excluded = excluded
        self.measured_steps = 0
        self.elapsed = 0.0
        self._steps_seen = 0
        self._last: float | None = time.perf_counter() if excluded == 0 else None
        self._paused = 0.0
        self._paused_at: float | None = None

    def step_done(self) -> None:
        now = time.perf_counter()
        self._steps_seen += 1
        if self._last is not None:
            self.measured_steps += 1
            self.elapsed += now - self._last - self._paused
        if self._steps_seen >= self.excluded:
            self._last = now
        self._paused = 0.0

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None


class RateWindow:
    """The rate since the previous log point, over a :class:`StepTimer`'s measured steps only: pauses
    and warmup steps are left out, as they are from the run's rate. None until a measured step."""

    def __init__(self, units_per_step: int) -> None:
        self.units_per_step = units_per_step
        self._last = (0, 0.0)  # (measured steps, measured seconds) at the previous call

    def rate(self, timer: StepTimer) -> float | None:
        steps, elapsed = timer.measured_steps, timer.elapsed
        last_steps, last_elapsed = self._last
        self._last = (steps, elapsed)
        if steps > last_steps and elapsed > last_elapsed:
            return self.units_per_step * (steps - last_steps) / (elapsed - last_elapsed)
        return None


def throughput(
    global_batch_size: int, measured_steps: int, elapsed_per_rank: list[float]
) -> tuple[float | None, float | None]:
    """Aggregate and per-worker images/s from the measured time of every rank.

    Synchronous data parallelism moves at the pace of its slowest rank, so the step time is
    the largest of the ranks' measured times divided by the steps. The aggregate rate is the
    global batch over that step time; it is never one rank's rate times the world size.
    """
    slowest = max(elapsed_per_rank)
    if measured_steps <= 0 or slowest <= 0:
        return None, None
    images_per_sec = global_batch_size * measured_steps / slowest
    return images_per_sec, images_per_sec / len(elapsed_per_rank)


def validate_metrics(metrics: dict[str, Any], keys: tuple[str, ...] = METRIC_KEYS) -> None:
    """Raise ValueError unless ``metrics`` has exactly the schema's keys (``keys``: another job's
    schema) and finite numbers (NaN and infinity are not JSON)."""
    if tuple(metrics) != keys:
        raise ValueError(f"metrics keys {sorted(metrics)} != schema {sorted(keys)}")
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metric {key} is {value}")


def write_metrics(path: Path, metrics: dict[str, Any], keys: tuple[str, ...] = METRIC_KEYS) -> None:
    """Validate, then write the metrics JSON atomically (a reader never sees half a file)."""
    validate_metrics(metrics, keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, path)
