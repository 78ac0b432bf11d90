"""The framework-neutral part of a training run: resume, LR, logs, timing, checkpoints, metrics, curves.

Each job owns its model and its step; it asks :class:`TrainingRun` for the LR before a step
and reports the step's loss after it. Keeping this in one place is what makes the three jobs'
schedules, checkpoints and numbers comparable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

from training.checkpoint.files import Checkpoint, CheckpointDir, Fingerprint
from training.checkpoint.writer import CheckpointWriter
from training.config.args import log_interval
from training.config.settings import TrainingSettings
from training.data.imagenet import SkipCounter
from training.errors import CheckpointRefused, JobError, first_line
from training.run import curves
from training.run.metrics import METRIC_KEYS, RateWindow, StepTimer, throughput, write_metrics
from training.run.outputs import output_error
from training.run.schedule import learning_rate
from training.run.slow_ranks import ComputeTimes, SlowRankWatch, hostname
from training.world.distributed import PEER_TIMEOUT_SECONDS, Dist, peer_timeout_seconds
from training.world.preemption import PreemptionWatch, stop

log = logging.getLogger(__name__)
T = TypeVar("T")


def configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def resume(
    settings: TrainingSettings,
    dist: Dist,
    fingerprint: Fingerprint,
    total_steps: int,
    decode: Callable[[bytes], T],
) -> tuple[int, T | None]:
    """Rank 0 finds the newest valid checkpoint; every rank gets its ``(step, state)``.

    ``(0, None)`` when there is nothing to resume. Only rank 0 reads the directory, so ranks
    cannot disagree about which checkpoint is newest (one may be landing as they look); its
    verdict and the payload are broadcast, and every rank decodes the same bytes. A refusal
    (a damaged or foreign directory, a checkpoint past this run's end) is raised on every rank.
    """
    found: Checkpoint | None = None
    refusal: str | None = None
    if dist.rank == 0 and settings.checkpoint_dir is not None:
        try:
            found = _find_checkpoint(settings, fingerprint, total_steps, decode)
        except CheckpointRefused as exc:
            refusal = str(exc)
    step, refusal = dist.broadcast_object((found.step if found else 0, refusal))
    if refusal is not None:
        raise CheckpointRefused(refusal, every_rank=True)
    if step == 0:
        return 0, None
    if dist.rank == 0:
        log.info("resuming from %s at step %d", settings.checkpoint_dir, step)
    return step, decode(dist.broadcast_bytes(found.payload if found else None))


def _find_checkpoint(
    settings: TrainingSettings, fingerprint: Fingerprint, total_steps: int, decode: Callable[[bytes], object]
) -> Checkpoint | None:
    checkpoints = CheckpointDir(settings.checkpoint_dir, settings.keep_checkpoints)
    checkpoints.remove_stale_temporaries()
    found = checkpoints.load_latest(fingerprint, decode, settings.ignore_bad_checkpoints)
    if found is not None and found.step > total_steps:
        raise CheckpointRefused(
            f"checkpoint {found.path} is at step {found.step}, past this run's {total_steps} steps: "
            "raise --steps or --epochs to continue it, or use another --checkpoint-dir"
        )
    return found


def restore(settings: TrainingSettings, step: int, apply: Callable[[], object]) -> None:
    """Load a resumed state into the job's objects: a state that does not fit them (another
    optimizer or precision) is a refusal on every rank, which all decode the same bytes."""
    try:
        apply()
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointRefused(
            f"the checkpoint of step {step} in {settings.checkpoint_dir} does not fit this run ({first_line(exc)}): "
            "resume with the flags that wrote it, or use another --checkpoint-dir",
            every_rank=True,
        ) from exc


class TrainingRun:
    """Bookkeeping around a job's step loop. Every rank creates one and calls it in step."""

    def __init__(
        self,
        settings: TrainingSettings,
        dist: Dist,
        *,
        steps_per_epoch: int,
        total_steps: int,
        start_step: int,
        precision: str,
        device: str,
        decoder: str | None,
        fingerprint: Fingerprint,
        save_state: Callable[[int], bytes | None],
        collective_save: bool = False,
        evaluate: Callable[[], tuple[int, int]] | None = None,
        on_epoch_end: Callable[[int, dict[str, Any]], None] | None = None,
        compute: ComputeTimes | None = None,
    ) -> None:
        self.settings = settings
        self.dist = dist
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.log_every = log_interval(settings.log_every, total_steps)
        self.epochs = math.ceil(total_steps / steps_per_epoch)  # the last one may be partial
        self.start_step = start_step
        self.global_batch_size = settings.batch_size * dist.size
        self.precision = precision
        self.device = device
        self.decoder = decoder  # what decodes the images (None: synthetic data)
        self._fingerprint = fingerprint
        self._save_state = save_state  # rank 0's payload; collective_save: every rank calls it, rank 0's is written
        self._collective_save = collective_save
        self._evaluate = evaluate
        self._on_epoch_end = on_epoch_end  # every rank, after evaluation, each epoch but the last: (epoch, progress)
        self._checkpoints = (
            CheckpointDir(settings.checkpoint_dir, settings.keep_checkpoints) if settings.checkpoint_dir else None
        )
        self._writer: CheckpointWriter | None = None
        # how long rank 0 may hold its peers while it writes a checkpoint: half what they would wait
        self._save_wait_s = (peer_timeout_seconds(dist.backend) or PEER_TIMEOUT_SECONDS) / 2
        # At least one measured step whenever a step runs, so short runs still report a rate.
        self.excluded = min(settings.timing_warmup_steps, max(self.total_steps - start_step - 1, 0))
        self._curves = curves.RunCurves(settings.tensorboard_dir, settings.summary_png, dist.rank, start_step)
        self._timer = StepTimer(self.excluded)
        self._last_loss: Callable[[], float] | None = None
        self._val_top1: float | None = None
        self._window = RateWindow(self.global_batch_size)
        self._preemption = PreemptionWatch(dist)
        # each rank's compute per step, judged by rank 0 at log steps (training/run/slow_ranks.py)
        self._compute = compute
        self._host = hostname()
        self._slow = SlowRankWatch(settings.slow_ranks_json) if dist.rank == 0 else None
        if dist.rank == 0:
            log.info(
                "%s/%s: %d workers x batch %d, %d steps (%d per epoch), starting at step %d",
                settings.framework,
                dist.backend,
                dist.size,
                settings.batch_size,
                self.total_steps,
                steps_per_epoch,
                start_step,
            )

    def lr(self, step: int) -> float:
        """LR for the step with 0-based global index ``step``."""
        optimizer = self.settings.optimizer
        return learning_rate(
            step,
            self.steps_per_epoch,
            optimizer.lr,
            optimizer.lr_scale(self.dist.size),  # data parallelism: a replica per process
            optimizer.warmup_epochs,
            optimizer.lr_decay_epochs,
        )

    def steps(self) -> range:
        """Global 0-based indices of the steps this run still has to take."""
        return range(self.start_step, self.total_steps)

    def step_done(self, step: int, loss: Callable[[], float]) -> None:
        """Report that step ``step`` (0-based) finished; ``loss`` returns its loss value.

        Calling ``loss`` waits for the device, so it is called only where that is needed:
        at timing boundaries, before checkpoints and evaluation, at log steps and at the end.
        """
        done = step + 1
        self._last_loss = loss
        log_due = done % self.log_every == 0
        epoch_end = done % self.steps_per_epoch == 0
        every = self.settings.checkpoint_every
        save_due = self._checkpoints is not None and (
            done == self.total_steps or (done % every == 0 if every else epoch_end)
        )
        eval_due = epoch_end and self._evaluate is not None
        # the end of the last epoch is the run's end, which finish() reports
        hook = self._on_epoch_end if epoch_end and done < self.total_steps else None
        timing_edge = done - self.start_step == self.excluded or done == self.total_steps
        if timing_edge or save_due or eval_due or hook is not None or log_due:
            loss()  # wait for the device, so the clock and the pauses see finished work
        self._timer.step_done()
        # the warmup's steps (compilation, autotuning) are no one's slowness: their spans are dropped where
        # the device has been waited for (the warmup's end, log steps)
        warming_up = done - self.start_step <= self.excluded
        if self._compute is not None and done - self.start_step == self.excluded:
            self._compute.take_window()
        if log_due:
            # the mean loss over ranks, as metrics.json and model.json report it, and each rank's compute
            # and host for the slow-rank check: one small collective
            span = self._compute.take_window() if self._compute is not None else None
            span = None if warming_up else span
            losses, spans, hosts = zip(*self.dist.allgather_object((loss(), span, self._host)), strict=True)
            if self.dist.rank == 0:
                self._log(done, sum(losses) / self.dist.size)
                assert self._slow is not None
                self._slow.observe(done, spans, hosts)
        if save_due:
            self._timer.pause()
            self._save(done)
            self._timer.resume()
        if eval_due:
            self._timer.pause()
            self._run_evaluation(done // self.steps_per_epoch)
            self._timer.resume()
        if hook is not None:
            self._timer.pause()
            epoch = done // self.steps_per_epoch
            hook(epoch, {"epochs": epoch, "steps": done, "loss": loss(), "val_top1": self._val_top1})
            self._timer.resume()
        if self._preemption.agreed():
            if self._checkpoints is not None and not save_due:
                self._save(done)
            raise stop(done, saved=self._checkpoints is not None)

    def _log(self, done: int, loss: float) -> None:
        rate = self._window.rate(self._timer)
        epoch = (done - 1) // self.steps_per_epoch + 1
        lr = self.lr(done - 1)
        shown = "" if rate is None else f" images/s {rate:.1f}"
        log.info("step %d/%d epoch %d loss %.4f lr %.5f%s", done, self.total_steps, epoch, loss, lr, shown)
        self._curves.record(done, {curves.LOSS: loss, curves.LR: lr, curves.IMAGES_PER_SEC: rate})

    def _save(self, done: int) -> None:
        payload = self._save_state(done) if self._collective_save or self.dist.rank == 0 else None
        if self.dist.rank == 0:
            assert self._checkpoints is not None and payload is not None
            if self._writer is None:  # the file is written beside training (training/checkpoint/writer.py)
                self._writer = CheckpointWriter(self._checkpoints, self._fingerprint)
            self._writer.submit(done, payload, self._save_wait_s)
        # Keep ranks together here, so the copy's time is not charged to the next step.
        self.dist.allgather_object(done)

    def _run_evaluation(self, epoch: int) -> None:
        assert self._evaluate is not None
        counts = self.dist.allgather_object(self._evaluate())
        correct, total = (sum(column) for column in zip(*counts, strict=True))
        self._val_top1 = correct / total if total else None
        if self.dist.rank == 0:
            log.info("epoch %d validation top-1 %.4f on %d images", epoch, self._val_top1 or 0.0, total)
            self._curves.record(epoch * self.steps_per_epoch, {curves.VAL_TOP1: self._val_top1})

    def finish(self, skipped: SkipCounter | None = None) -> dict[str, Any]:
        """Collect the run's metrics on all ranks; rank 0 writes ``--metrics-json``.

        ``skipped`` counts this rank's unreadable images (None for synthetic data); the report
        sums all ranks. Raises :class:`JobError` after writing the metrics if the loss is not finite.
        """
        self._preemption.close()
        if self._evaluate is not None and self._val_top1 is None:
            self._run_evaluation(self.total_steps // self.steps_per_epoch)
        loss = self._last_loss() if self._last_loss is not None else None
        skipped_images = None if skipped is None else skipped.count
        gathered = self.dist.allgather_object((self._timer.elapsed, loss, skipped_images))
        elapsed, losses, skipped_per_rank = zip(*gathered, strict=True)
        images_per_sec, per_worker = throughput(self.global_batch_size, self._timer.measured_steps, list(elapsed))
        final_loss = None if loss is None else sum(losses) / len(losses)
        diverged = final_loss is not None and not math.isfinite(final_loss)
        metrics = dict.fromkeys(METRIC_KEYS)
        metrics.update(
            framework=self.settings.framework,
            backend=self.dist.backend,
            world_size=self.dist.size,
            batch_size_per_worker=self.settings.batch_size,
            global_batch_size=self.global_batch_size,
            steps=self.total_steps,
            epochs=self.epochs,
            warmup_steps_excluded=self.excluded if self._timer.measured_steps else 0,
            images_per_sec=images_per_sec,
            images_per_sec_per_worker=per_worker,
            final_loss=None if diverged else final_loss,
            val_top1=self._val_top1,
            resumed_from_step=self.start_step or None,
            precision=self.precision,
            device=self.device,
            decoder=self.decoder,
            skipped_images=None if skipped_images is None else sum(skipped_per_rank),
        )
        if self.dist.rank == 0:
            log.info("metrics: %s", metrics)
            if self.settings.metrics_json is not None:
                try:
                    write_metrics(self.settings.metrics_json, metrics)
                except OSError as exc:
                    raise output_error("--metrics-json", self.settings.metrics_json, exc) from None
            self._finish_curves(final_loss, images_per_sec)
        if diverged:
            raise JobError(f"training diverged: the final loss is {final_loss}", every_rank=True)
        return metrics

    def _finish_curves(self, loss: float | None, images_per_sec: float | None) -> None:
        final: dict[str, float | None] = {curves.FINAL_IMAGES_PER_SEC: images_per_sec}
        if self.total_steps % self.log_every:  # the last step was not logged: end the loss curve there
            final[curves.LOSS] = loss
        title = (
            f"{self.settings.framework} ({self.dist.backend}) {self.settings.model}: "
            f"world size {self.dist.size}, batch {self.settings.batch_size} per worker"
        )
        self._curves.finish(self.total_steps, final, title)
