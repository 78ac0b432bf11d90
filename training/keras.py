"""Keras job: ``horovodrun ... python -m training.keras``.

``model.fit`` with ``hvd.DistributedOptimizer`` averaging the gradients. The initial (or
resumed) variables are broadcast from rank 0 before ``fit``, rather than by Horovod's
``BroadcastGlobalVariablesCallback``, which broadcasts only after the first batch: that first
step would otherwise average gradients taken at different weights. A callback drives the
shared per-step bookkeeping (LR schedule, logs, checkpoints, timing); Keras's own ``train_step``, with
the time its loss is computed added to the logs (:func:`timed_train_step`), gives the slow-rank check
each rank's compute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NoReturn

import horovod.tensorflow.keras as hvd_keras
import tensorflow as tf

from training.config.settings import TrainingSettings
from training.run.job import run_job
from training.run.loop import TrainingRun
from training.run.slow_ranks import HostComputeTimes
from training.tf import common as tf_common

FORWARD_DONE = "forward_done"  # the logs' entry of tf_common.forward_done


def _distributed(optimizer: tf.keras.optimizers.Optimizer, settings: TrainingSettings) -> tf.keras.optimizers.Optimizer:
    # compile() adds loss scaling itself under the mixed_float16 policy.
    return hvd_keras.DistributedOptimizer(optimizer, compression=tf_common.compression(settings))


def timed_train_step(model: tf.keras.Model) -> None:
    """Keras's ``Model.train_step`` (tf.keras 2.15's, line for line), with :func:`tf_common.forward_done` in its
    logs. An instance attribute: ``make_train_function`` calls ``model.train_step``."""
    unpack = tf.keras.utils.unpack_x_y_sample_weight

    def train_step(data: Any) -> dict[str, tf.Tensor]:
        x, y, sample_weight = unpack(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
        forward_end = tf_common.forward_done(loss)
        model.optimizer.minimize(loss, model.trainable_variables, tape=tape)  # DistributedOptimizer: allreduce
        return {**model.compute_metrics(x, y, y_pred, sample_weight), FORWARD_DONE: forward_end}

    model.train_step = train_step


class StepCallback(tf.keras.callbacks.Callback):
    """Feeds every batch into :class:`TrainingRun`, counting global steps from the resume point."""

    def __init__(self, run: TrainingRun, compute: HostComputeTimes) -> None:
        super().__init__()
        self.run = run
        self.compute = compute
        self.step = run.start_step
        self._asked = 0.0
        self._supports_tf_logs = True  # keep the loss a tensor: reading it would sync every step

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._asked = time.time()  # before fit's step asks for its batch: the wait for data is the rank's own
        self.model.optimizer.learning_rate = self.run.lr(self.step)
        # Keras reports the running mean of the loss; resetting makes it this batch's loss.
        self.model.reset_metrics()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        loss = logs["loss"]
        self.compute.add(self._asked, logs[FORWARD_DONE])
        self.run.step_done(self.step, lambda: float(loss))
        self.step += 1


def train(settings: TrainingSettings, dist: tf_common.HorovodTF) -> dict[str, Any]:
    s = tf_common.setup(settings, dist, _distributed)
    s.model.compile(
        optimizer=s.optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    timed_train_step(s.model)
    run = s.training_run()
    remaining = run.total_steps - run.start_step
    with s.pipeline_errors.unwrapped():
        if remaining:
            if s.plan.train is None:
                # fit() reads from tf.data, which lives on the host: the fixed uint8 batch is copied
                # to the GPU every step, overlapped with compute by the prefetch.
                dataset = tf.data.Dataset.from_tensors(s.synthetic_tensors()).repeat().prefetch(tf.data.AUTOTUNE)
            else:
                dataset = s.train_dataset(run.total_steps)
            # One Keras "epoch" of all remaining steps: Keras cannot start mid-epoch, and our
            # epochs (LR decay, evaluation, checkpoints) are counted by the callback instead.
            s.model.fit(
                dataset, epochs=1, steps_per_epoch=remaining, callbacks=[StepCallback(run, s.compute)], verbose=0
            )
        return s.finish(run)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    run_job("keras", argv, tf_common.start_backend, train)


if __name__ == "__main__":
    main()
