"""What the TensorFlow and Keras jobs share: Horovod and GPU setup, precision, input
pipelines, and model/optimizer state (checkpoint, resume, broadcast). The two jobs differ only
in how they take a step: a custom loop with ``DistributedGradientTape``, or ``model.fit`` with
``DistributedOptimizer``.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.common.exceptions import HorovodInternalError

from training.checkpoint.files import Fingerprint
from training.config.settings import TrainingSettings
from training.data.decode import decoder_name
from training.data.imagenet import (
    DataPlan,
    ImageFolder,
    Key,
    SkipCounter,
    default_workers,
    plan_data,
    synthetic_batch,
    train_keys,
    val_keys,
)
from training.errors import JobError
from training.run.export import Exporter, ExportSpec, ModelFiles
from training.run.loop import TrainingRun, restore, resume
from training.run.slow_ranks import HostComputeTimes
from training.tf.models import build_model
from training.world.distributed import agree, set_failure_timeouts

log = logging.getLogger(__name__)

T = TypeVar("T")


class HorovodTF:
    backend = "horovod"
    # A failed collective; a failed op or input pipeline (ours are unwrapped by PipelineErrors).
    failures = (HorovodInternalError, tf.errors.OpError)

    def __init__(self) -> None:
        set_failure_timeouts()  # before init: Horovod reads them when it starts
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        # One GPU per process; memory growth so TensorFlow does not grab the whole card upfront.
        gpus = tf.config.list_physical_devices("GPU")
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        if gpus:
            tf.config.set_visible_devices(gpus[self.local_rank], "GPU")

    # Horovod matches collectives across ranks by name and names these after the object's
    # type by default, so rank 0's checkpoint and the other ranks' None would never meet.
    def broadcast_object(self, obj: T) -> T:
        return hvd.broadcast_object(obj, root_rank=0, name="training.broadcast_object")

    def allgather_object(self, obj: Any) -> list[Any]:
        return hvd.allgather_object(obj, name="training.allgather_object")

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        size = self.broadcast_object(len(data) if data is not None else None)
        buffer = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(size, dtype=np.uint8)
        return hvd.broadcast(tf.constant(buffer), root_rank=0, name="training.broadcast_bytes").numpy().tobytes()

    def start_vote(self, flag: bool) -> Callable[[], bool]:
        # eager Horovod ops run at once: this one is answered before it returns
        total = int(hvd.allreduce(tf.constant([int(flag)]), op=hvd.Sum, name="training.vote")[0])
        return lambda: total > 0

    def shutdown(self) -> None:
        hvd.shutdown()


def set_precision(precision: str) -> str:
    """Set the Keras mixed-precision policy; return the precision label for the metrics.

    amp is bfloat16 on CPUs and on GPUs of compute capability 8.0+ (Ampere, Hopper), float16
    with loss scaling on older GPUs.
    """
    if precision == "fp32":
        tf.keras.mixed_precision.set_global_policy("float32")
        return "fp32"
    gpus = tf.config.get_visible_devices("GPU")
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability") if gpus else None
    if capability is not None and capability < (8, 0):
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        return "amp_fp16"
    tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    return "amp_bf16"


def device_name() -> str:
    gpus = tf.config.get_visible_devices("GPU")
    if not gpus:
        return "cpu"
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")


class PipelineErrors:
    """Our errors raised inside tf.data's threads. TensorFlow hands them back wrapped in an
    ``UnknownError`` whose text is the Python traceback; :meth:`unwrapped` raises ours instead."""

    def __init__(self) -> None:
        self.first: JobError | None = None

    def record(self, exc: JobError) -> None:
        if self.first is None:  # several decode threads may fail at once; any of them says it
            self.first = exc

    @contextmanager
    def unwrapped(self) -> Iterator[None]:
        try:
            yield
        except tf.errors.OpError:
            if self.first is None:
                raise
            raise self.first from None


def image_dataset(
    folder: ImageFolder,
    key_batches: Iterable[list[Key]],
    batch_size: int,
    skipped: SkipCounter,
    errors: PipelineErrors,
) -> tf.data.Dataset:
    """Decode keys in parallel (AUTOTUNE threads; PIL releases the GIL while decoding)."""

    def keys() -> Iterable[Key]:
        for batch in key_batches:
            yield from batch

    def load(key: np.ndarray) -> tuple[np.ndarray, np.int32]:
        try:
            image, label, n = folder[int(key[0]), int(key[1])]
        except JobError as exc:
            errors.record(exc)
            raise
        skipped.add(n)
        return image, np.int32(label)

    def load_op(key: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        image, label = tf.numpy_function(load, [key], (tf.uint8, tf.int32), stateful=False)
        image.set_shape((folder.image_size, folder.image_size, 3))
        label.set_shape(())
        return image, label

    dataset = tf.data.Dataset.from_generator(keys, output_signature=tf.TensorSpec((2,), tf.int64))
    dataset = dataset.map(load_op, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


@dataclass
class Setup:
    """Everything both TensorFlow jobs build before their first step."""

    settings: TrainingSettings
    dist: HorovodTF
    plan: DataPlan
    model: tf.keras.Model
    optimizer: tf.keras.optimizers.Optimizer
    start_step: int
    precision: str
    fingerprint: Fingerprint
    skipped: SkipCounter = field(default_factory=SkipCounter)
    pipeline_errors: PipelineErrors = field(default_factory=PipelineErrors)
    # each step's (time.time() as it asked for its batch, forward_done()): data + forward + loss, the slow-rank check's
    compute: HostComputeTimes = field(default_factory=HostComputeTimes)
    exporter: Exporter | None = None  # made with the TrainingRun, which calls it at epoch ends
    serving: Serving | None = None  # the float32 copy exports are taken from, made at the first export

    def synthetic_tensors(self) -> tuple[tf.Tensor, tf.Tensor]:
        """This rank's fixed synthetic batch, created once on the device."""
        images, labels = synthetic_batch(
            self.settings.seed,
            self.dist.rank,
            self.settings.batch_size,
            self.settings.image_size,
            self.plan.num_classes,
        )
        with tf.device("/GPU:0" if tf.config.get_visible_devices("GPU") else "/CPU:0"):
            return tf.identity(images), tf.identity(labels.astype(np.int32))

    def train_dataset(self, total_steps: int) -> tf.data.Dataset:
        assert self.plan.train is not None
        keys = train_keys(
            len(self.plan.train),
            self.dist.rank,
            self.dist.size,
            self.settings.batch_size,
            self.settings.seed,
            self.plan.steps_per_epoch,
            self.start_step,
            total_steps,
        )
        return self._with_threads(self._images(self.plan.train, keys))

    def _images(self, folder: ImageFolder, keys: Iterable[list[Key]]) -> tf.data.Dataset:
        return image_dataset(folder, keys, self.settings.batch_size, self.skipped, self.pipeline_errors)

    def _with_threads(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        workers = self.settings.data_workers
        options = tf.data.Options()
        # 0 means TensorFlow's shared thread pool.
        options.threading.private_threadpool_size = (
            default_workers(self.dist.local_size) if workers is None else workers
        )
        return dataset.with_options(options)

    def evaluate(self) -> Callable[[], tuple[int, int]] | None:
        val = self.plan.val
        if val is None:
            return None
        model = self.model

        @tf.function(reduce_retracing=True)
        def correct(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            predictions = tf.argmax(model(images, training=False), axis=1, output_type=tf.int32)
            return tf.reduce_sum(tf.cast(predictions == labels, tf.int32))

        def run() -> tuple[int, int]:
            keys = val_keys(len(val), self.dist.rank, self.dist.size, self.settings.batch_size)
            hits = total = 0
            for images, labels in self._with_threads(self._images(val, keys)):
                hits += int(correct(images, labels))
                total += int(labels.shape[0])
            return hits, total

        return run

    def save_state(self, step: int) -> bytes:
        arrays = {f"model_{i}": v.numpy() for i, v in enumerate(self.model.variables)}
        arrays.update({f"optimizer_{i}": v.numpy() for i, v in enumerate(self.optimizer.variables)})
        buffer = io.BytesIO()
        np.savez(buffer, step=np.int64(step), **arrays)
        return buffer.getvalue()

    def training_run(self) -> TrainingRun:
        self.exporter = Exporter(self.settings, self.dist, ExportSpec.of(self.settings, self.plan), self.save_export)
        return TrainingRun(
            self.settings,
            self.dist,
            steps_per_epoch=self.plan.steps_per_epoch,
            total_steps=self.plan.total_steps,
            start_step=self.start_step,
            precision=self.precision,
            device=device_name(),
            decoder=None if self.plan.train is None else decoder_name(),
            fingerprint=self.fingerprint,
            save_state=self.save_state,
            evaluate=self.evaluate(),
            on_epoch_end=self.exporter.epoch_hook,
            compute=self.compute,
        )

    def finish(self, run: TrainingRun) -> dict[str, Any]:
        """The run's metrics (:meth:`TrainingRun.finish`), then the export of the trained model."""
        metrics = run.finish(self.skip_counter())
        assert self.exporter is not None, "training_run() makes the exporter"
        self.exporter.final(metrics)
        return metrics

    def save_export(self, directory: Path) -> ModelFiles:
        """``saved_model/``, whose serving signature takes uint8 images [N, size, size, 3] and
        returns ``probabilities`` [N, classes], from a float32 copy of the model in inference mode."""
        if self.serving is None:
            self.serving = Serving(self.settings.model, self.plan.num_classes, self.settings.image_size)
        self.serving.load(self.model)
        signature = self.serving.serve.get_concrete_function()
        tf.saved_model.save(self.serving, str(directory / "saved_model"), signatures={"serving_default": signature})
        return ModelFiles("saved_model", "saved_model", "probabilities")

    def skip_counter(self) -> SkipCounter | None:
        return None if self.plan.train is None else self.skipped


class Serving(tf.Module):
    """What the SavedModel holds: the weights and one function. The Keras model is built in float32
    whatever the training precision (a bfloat16 graph is slow or unsupported on many CPUs), and
    reached only through the function, so the export carries no optimizer and no Keras internals."""

    def __init__(self, name: str, num_classes: int, image_size: int) -> None:
        super().__init__()
        training_policy = tf.keras.mixed_precision.global_policy()
        tf.keras.mixed_precision.set_global_policy("float32")
        try:
            model = build_model(name, num_classes, image_size)
        finally:
            tf.keras.mixed_precision.set_global_policy(training_policy)
        self.model_variables = list(model.variables)  # tracked, so the function's captures are saved

        @tf.function(input_signature=[tf.TensorSpec([None, image_size, image_size, 3], tf.uint8, name="images")])
        def serve(images: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"probabilities": tf.nn.softmax(model(images, training=False))}

        self.serve = serve

    def load(self, trained: tf.keras.Model) -> None:
        """Take the trained model's weights (the same architecture, so the same variable order)."""
        for variable, value in zip(self.model_variables, trained.variables, strict=True):
            variable.assign(value)


def decode_state(payload: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(payload)) as arrays:
        return {name: arrays[name] for name in arrays.files}


def _assign(prefix: str, variables: Sequence[tf.Variable], state: dict[str, np.ndarray]) -> None:
    saved = sum(1 for name in state if name.startswith(prefix + "_"))
    if saved != len(variables):
        raise ValueError(
            f"checkpoint has {saved} {prefix} variables, this job has {len(variables)}: "
            "was it written with another --model, --num-classes or --precision?"
        )
    for i, variable in enumerate(variables):
        variable.assign(state[f"{prefix}_{i}"])


def setup(
    settings: TrainingSettings,
    dist: HorovodTF,
    wrap_optimizer: Callable[[tf.keras.optimizers.Optimizer, TrainingSettings], tf.keras.optimizers.Optimizer],
) -> Setup:
    """Build data, model and optimizer, resume, broadcast."""
    # Ranks start from different random weights on purpose: the broadcast below must make
    # them equal, and the equivalence test checks that it does.
    tf.keras.utils.set_random_seed(settings.seed + dist.rank)
    precision = set_precision(settings.precision)
    plan = agree(dist, lambda: plan_data(settings, dist.size))
    model = build_model(settings.model, plan.num_classes, settings.image_size)
    optimizer = wrap_optimizer(
        tf.keras.optimizers.SGD(
            learning_rate=settings.optimizer.lr,
            momentum=settings.optimizer.momentum,
            weight_decay=settings.optimizer.weight_decay or None,
        ),
        settings,
    )
    optimizer.build(model.trainable_variables)  # create slots now, so they can be restored and broadcast
    # "tensorflow" for both jobs: they write the same checkpoints, so either may resume the other's.
    # Keras' variable names depend on how many models the process built before: shapes only.
    shapes = (tuple(v.shape) for v in model.variables)
    fingerprint = Fingerprint.of("tensorflow", settings.model, plan.num_classes, shapes)
    start_step, state = resume(settings, dist, fingerprint, plan.total_steps, decode_state)
    if state is not None:
        restore(settings, start_step, lambda: _assign("model", model.variables, state))
        restore(settings, start_step, lambda: _assign("optimizer", optimizer.variables, state))
    hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)
    return Setup(settings, dist, plan, model, optimizer, start_step, precision, fingerprint)


def forward_done(loss: tf.Tensor) -> tf.Tensor:
    """In a step's graph: the time (``tf.timestamp``, Unix seconds, as ``time.time()``) at which ``loss`` is
    computed, taken on the host once the loss has reached it, so that on a GPU it is when the forward pass
    ran, not when its kernels were queued. The backward pass does not wait for it, and the gradients'
    allreduce comes after it: the span to it is the rank's own (training/run/slow_ranks.py)."""
    with tf.device("/CPU:0"):
        on_host = tf.identity(loss)
        with tf.control_dependencies([on_host]):
            return tf.timestamp()


def compression(settings: TrainingSettings) -> Any:
    """Horovod's gradient compression for --fp16-allreduce."""
    return hvd.Compression.fp16 if settings.fp16_allreduce else hvd.Compression.none


def start_backend(settings: TrainingSettings) -> HorovodTF:
    return HorovodTF()
