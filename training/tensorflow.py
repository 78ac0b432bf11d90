"""TensorFlow job: ``horovodrun ... python -m training.tensorflow``.

A custom training loop: ``hvd.DistributedGradientTape`` averages the gradients, and the
initial (or resumed) variables are broadcast from rank 0 before the first step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any, NoReturn

import horovod.tensorflow as hvd
import tensorflow as tf

from training.config.settings import TrainingSettings
from training.run.job import run_job
from training.tf import common as tf_common


def _plain_or_loss_scaled(
    optimizer: tf.keras.optimizers.Optimizer, settings: TrainingSettings
) -> tf.keras.optimizers.Optimizer:
    # float16 needs loss scaling; bfloat16 has float32's range and does not.
    if tf.keras.mixed_precision.global_policy().name == "mixed_float16":
        return tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def train(settings: TrainingSettings, dist: tf_common.HorovodTF) -> dict[str, Any]:
    s = tf_common.setup(settings, dist, _plain_or_loss_scaled)
    model, optimizer = s.model, s.optimizer
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    scaled = isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
    compression = tf_common.compression(s.settings)

    @tf.function
    def train_step(images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
            objective = optimizer.get_scaled_loss(loss) if scaled else loss
        forward_end = tf_common.forward_done(loss)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(objective, model.trainable_variables)
        if scaled:
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss, forward_end

    run = s.training_run()
    batches: Iterator[tuple[tf.Tensor, tf.Tensor]] = (
        repeat(s.synthetic_tensors()) if s.plan.train is None else iter(s.train_dataset(run.total_steps))
    )
    with s.pipeline_errors.unwrapped():
        asked = time.time()  # as the step asks for its batch: the wait for data is the rank's own
        for step, (images, labels) in zip(run.steps(), batches, strict=False):
            optimizer.learning_rate = run.lr(step)
            loss, forward_end = train_step(images, labels)
            s.compute.add(asked, forward_end)
            run.step_done(step, lambda loss=loss: float(loss))
            asked = time.time()
        return s.finish(run)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    run_job("tensorflow", argv, tf_common.start_backend, train)


if __name__ == "__main__":
    main()
