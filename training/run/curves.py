"""A run's training curves: TensorBoard event files and ``summary.png``, both written by rank 0.

:class:`Curves` records scalars at the loop's log points, evaluations and end: each goes to an
event file under ``--tensorboard-dir`` (when given) and stays in memory for the PNG.

The event file is written with TensorBoard's own record writer and protos, not its
``EventFileWriter``: that one opens files through ``tensorboard.compat.tf``, which imports
TensorFlow wherever it is installed, and the PyTorch job must neither pay for nor depend on it.
tensorboard and matplotlib are imported only when a run asks for their output.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.run import tracking
from training.run.outputs import output_error

if TYPE_CHECKING:
    from matplotlib.axes import Axes

log = logging.getLogger(__name__)

LOSS = "train/loss"  # the mean of the ranks' losses at each log step, as metrics.json reports the last
LR = "train/lr"
IMAGES_PER_SEC = "train/images_per_sec"  # global, over the measured step time since the previous log step
VAL_TOP1 = "val/top1"
FINAL_IMAGES_PER_SEC = "final/images_per_sec"  # the measured rate of the metrics JSON, at the last step
TOKENS_PER_SEC = "train/tokens_per_sec"  # the transformers' rate, as images/s is the ResNets'
FINAL_TOKENS_PER_SEC = "final/tokens_per_sec"
MEMORY_GIB = "memory/rank{rank}_gib"  # model-parallel runs: each rank's peak memory so far
RATES = {"images": (IMAGES_PER_SEC, FINAL_IMAGES_PER_SEC), "tokens": (TOKENS_PER_SEC, FINAL_TOKENS_PER_SEC)}

PNG_SIZE = (1200, 500)  # pixels
_DPI = 100
_file_numbers = itertools.count()  # two writers of one process in the same second get distinct files

Series = Mapping[str, Sequence[tuple[int, float]]]


class EventFile:
    """One TensorBoard event file, written synchronously (the caller flushes it at each log point,
    so a run killed mid-way leaves readable events)."""

    def __init__(self, directory: Path, start_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a directory's files in name order: a resumed run's file sorts after the first.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_file_numbers)}"
        self.path = directory / name
        self._writer = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 (closed in close())
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        # A (re)start after start_step: TensorBoard drops what an interrupted run logged past its checkpoint.
        restart = SessionLog(status=SessionLog.START)
        self._write(Event(wall_time=time.time(), step=start_step + 1, session_log=restart))
        self.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        values_pb = [self._summary.Value(tag=tag, simple_value=value) for tag, value in values.items()]
        self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values_pb)))

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Curves:
    """Rank 0's scalars: to the event file of ``tensorboard_dir`` if given, and in memory for the PNG."""

    def __init__(self, tensorboard_dir: Path | None, start_step: int) -> None:
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.events = EventFile(tensorboard_dir, start_step) if tensorboard_dir is not None else None

    def add(self, step: int, values: Mapping[str, float | None]) -> None:
        """Record ``values`` (tag -> value, None where nothing was measured) at global step ``step``."""
        present = {tag: float(value) for tag, value in values.items() if value is not None}
        for tag, value in present.items():
            self.series.setdefault(tag, []).append((step, value))
        if self.events is not None and present:
            self.events.scalars(step, present)
            self.events.flush()

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


class RunCurves:
    """Rank 0's curves of one run, kept when ``--tensorboard-dir`` or ``--summary-png`` asks for them
    (on other ranks, and otherwise, every call does nothing). ``unit`` names the rate: images or tokens.
    File-system errors become the flag's :class:`~training.errors.OutputPathError`."""

    def __init__(
        self, tensorboard_dir: Path | None, summary_png: Path | None, rank: int, start_step: int, unit: str = "images"
    ) -> None:
        self.tensorboard_dir, self.summary_png, self.unit = tensorboard_dir, summary_png, unit
        self.rate_tag, self.final_rate_tag = RATES[unit]
        self.curves: Curves | None = None
        if rank != 0 or (tensorboard_dir is None and summary_png is None):
            return
        try:
            self.curves = Curves(tensorboard_dir, start_step)
        except OSError as exc:
            raise output_error("--tensorboard-dir", tensorboard_dir, exc) from None
        if self.curves.events is not None:
            log.info("TensorBoard events: %s", self.curves.events.path)

    def record(self, step: int, values: Mapping[str, float | None]) -> None:
        tracking.metrics(step, values)  # MLflow, from rank 0, when the run is tracked; never blocks
        if self.curves is None:
            return
        try:
            self.curves.add(step, values)  # flushed: a run killed later still leaves these
        except OSError as exc:
            raise output_error("--tensorboard-dir", self.tensorboard_dir, exc) from None

    def finish(self, step: int, final: Mapping[str, float | None], title: str) -> None:
        """Record ``final`` at the last step, close the event file and draw ``--summary-png``."""
        if self.curves is None:
            return
        self.record(step, final)
        try:
            self.curves.close()
        except OSError as exc:
            raise output_error("--tensorboard-dir", self.tensorboard_dir, exc) from None
        png = self.summary_png
        if png is None:
            return
        try:
            write_summary_png(png, self.curves.series, title, self.unit)
        except OSError as exc:
            raise output_error("--summary-png", png, exc) from None
        log.info("wrote %s", png)


def write_summary_png(path: Path, series: Series, title: str, unit: str = "images") -> None:
    """Plot loss and the rate (``unit``/s) over steps into ``path``, atomically (a reader never sees
    half a file)."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state; Agg renders the PNG

    figure = Figure(figsize=(PNG_SIZE[0] / _DPI, PNG_SIZE[1] / _DPI), dpi=_DPI, layout="constrained")
    figure.suptitle(title)
    loss_axes, rate_axes = figure.subplots(1, 2)
    _panel(loss_axes, series.get(LOSS, ()), "loss (mean over ranks)", "C0")
    rate_tag, final_rate_tag = RATES[unit]
    _panel(rate_axes, series.get(rate_tag, ()), f"{unit}/s (global, per log window)", "C1")
    for step, rate in series.get(final_rate_tag, ())[-1:]:
        rate_axes.axhline(rate, color="C2", linestyle="--")
        rate_axes.plot([step], [rate], "*", color="C2", markersize=12, label=f"measured over the run: {rate:.1f}")
        rate_axes.legend(loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        figure.savefig(tmp, format="png")
    except BaseException:
        with contextlib.suppress(OSError):  # a half-written file must not be uploaded with the run
            tmp.unlink()
        raise
    os.replace(tmp, path)


def _panel(axes: Axes, points: Sequence[tuple[int, float]], label: str, color: str) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [step for step, _ in points]
    values = [value for _, value in points]
    axes.plot(steps, values, marker="o", markersize=4, color=color)  # markers: one point still shows
    axes.set_xlabel("step")
    axes.set_ylabel(label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axes.grid(alpha=0.3)
