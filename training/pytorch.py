"""PyTorch job: ``horovodrun ... python -m training.pytorch`` or ``torchrun ... --backend ddp``.

Horovod: ``hvd.DistributedOptimizer`` averages gradients, ``hvd.broadcast_parameters`` makes
rank 0's initial weights everyone's. DDP: ``DistributedDataParallel`` does both. Either way
the flags, the schedule, the checkpoints and the metrics JSON are the same.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from itertools import repeat
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.checkpoint.files import Fingerprint
from training.config.activation_checkpointing import AUTO
from training.config.args import SGD
from training.config.settings import TrainingSettings
from training.config.sync import HIERARCHICAL
from training.data.decode import decoder_name
from training.data.decode_choice import measure_rates, probe_batches, warm_batches
from training.data.gpu_decode import (
    DeviceBatcher,
    EncodedFolder,
    GpuDecode,
    choose_decoder,
    collate_encoded,
)
from training.data.imagenet import (
    DataPlan,
    ImageFolder,
    SkipCounter,
    default_workers,
    plan_data,
    synthetic_batch,
    train_keys,
    val_keys,
)
from training.data.side_stream import Batch, SideStreamBatches, streams_for
from training.errors import BadInput, JobError, NotReady
from training.run.export import Exporter, ExportSpec, ModelFiles
from training.run.job import run_job
from training.run.loop import TrainingRun, configure_logging, restore, resume
from training.torch.compute_clock import ComputeClock
from training.torch.models import build_model
from training.torch.profiling import StepProfiler
from training.torch.sync import PeriodicSync, check_layout, refuse_replicas
from training.world import preemption
from training.world.distributed import agree, set_failure_timeouts
from training.world.lifetime import die_with

log = logging.getLogger(__name__)
T = TypeVar("T")


class HorovodBackend:
    backend = "horovod"

    def __init__(self) -> None:
        set_failure_timeouts()  # before init: Horovod reads them when it starts
        try:
            import horovod.torch as hvd
            from horovod.common.exceptions import HorovodInternalError
        except ImportError as exc:
            raise NotReady(
                f"the horovod backend needs Horovod, which does not import here ({type(exc).__name__}: {exc}): "
                "start the job with torchrun (--backend auto then runs ddp), or install Horovod (the framework "
                "image, `make setup`)"
            ) from None

        hvd.init()
        self.hvd = hvd
        self.failures = (HorovodInternalError,)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    # Horovod matches collectives across ranks by name and names these after the object's
    # type by default, so rank 0's checkpoint and the other ranks' None would never meet.
    def broadcast_object(self, obj: T) -> T:
        return self.hvd.broadcast_object(obj, root_rank=0, name="training.broadcast_object")

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.hvd.allgather_object(obj, name="training.allgather_object")

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        size = self.broadcast_object(len(data) if data is not None else None)
        buffer = _byte_tensor(data, size, torch.device("cpu"))
        self.hvd.broadcast_(buffer, root_rank=0, name="training.broadcast_bytes")
        return buffer.numpy().tobytes()

    def start_vote(self, flag: bool) -> Callable[[], bool]:
        # a CPU tensor: Horovod reduces it over gloo in its background thread, off the GPU's stream
        handle = self.hvd.allreduce_async(torch.tensor([int(flag)]), op=self.hvd.Sum, name="training.vote")
        return lambda: int(self.hvd.synchronize(handle)) > 0

    def distribute(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fp16_allreduce: bool
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = self.hvd.Compression.fp16 if fp16_allreduce else self.hvd.Compression.none
        # A new optimizer holds no state yet (checkpoint state is loaded after this), so there
        # is no optimizer state to broadcast.
        optimizer = self.hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression
        )
        return model, optimizer

    def drop_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.synchronize()  # Horovod refuses zero_grad with its allreduces still in flight
        optimizer.zero_grad()

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        # The scaler must see averaged gradients, so that every rank agrees on skipping a step
        # with overflowed fp16 gradients: finish the allreduce first, then step without it.
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            scaler.step(optimizer)

    def shutdown(self) -> None:
        self.hvd.shutdown()


class DDPBackend:
    backend = "ddp"

    failures = (torch.distributed.DistError,)

    def __init__(self) -> None:
        if "RANK" not in os.environ:
            raise BadInput("--backend ddp runs under torchrun: torchrun --nproc-per-node N -m training.pytorch ...")
        timeouts = set_failure_timeouts()
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.local_size = int(os.environ["LOCAL_WORLD_SIZE"])
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)  # NCCL object collectives use the current device
        timeout = timedelta(seconds=int(timeouts["DDP_TIMEOUT_SECONDS"]))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
        # the step-boundary votes: a gloo group of their own, so that they never wait for the GPU
        self._votes = torch.distributed.new_group(backend="gloo", timeout=timeout)

    def broadcast_object(self, obj: T) -> T:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:  # no collective (and its device copies) in a one-process run's log steps
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        size = self.broadcast_object(len(data) if data is not None else None)
        # NCCL broadcasts GPU tensors only.
        device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        buffer = _byte_tensor(data, size, device)
        torch.distributed.broadcast(buffer, src=0)
        return buffer.cpu().numpy().tobytes()

    def start_vote(self, flag: bool) -> Callable[[], bool]:
        box = torch.tensor([int(flag)])
        work = torch.distributed.all_reduce(box, group=self._votes, async_op=True)

        def answer() -> bool:
            work.wait()
            return int(box) > 0

        return answer

    def distribute(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, fp16_allreduce: bool
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        # Channels-last weights match the layout of their gradients, so DDP's buckets need no copies.
        model.to(memory_format=torch.channels_last)
        if self.size == 1:
            # Nothing to average: the wrapper would only copy gradients into buckets, all-reduce
            # them with itself and, compiled, split the graph at bucket boundaries.
            return model, optimizer
        device_ids = [self.local_rank] if torch.cuda.is_available() else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)  # broadcasts rank 0's weights
        if fp16_allreduce:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, optimizer

    def drop_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        scaler.step(optimizer)

    def shutdown(self) -> None:
        torch.distributed.destroy_process_group()


Backend = HorovodBackend | DDPBackend


def _byte_tensor(data: bytes | None, size: int, device: torch.device) -> torch.Tensor:
    """``data`` as a uint8 tensor on rank 0, an empty one of ``size`` bytes elsewhere."""
    if data is None:
        return torch.empty(size, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """``amp``: bfloat16 where the hardware has it (CPU, Ampere, Hopper): same range as fp32, no loss
    scaling; float16 with a GradScaler on older GPUs (V100). ``bf16``: bfloat16 everywhere."""
    if precision == "fp32":
        return None
    if precision == "bf16":  # asked for by name: bf16 compute over fp32 weights, as on a mesh
        return torch.bfloat16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def collate(samples: list[tuple[np.ndarray, int, int]]) -> Batch:
    images, labels, skipped = zip(*samples, strict=True)
    return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64), sum(skipped)


def image_loader(
    folder: ImageFolder,
    keys: Iterator[list],
    settings: TrainingSettings,
    backend: Backend,
    device: torch.device,
    decode: GpuDecode | None = None,
) -> Iterator[Batch]:
    """Decode batches in worker processes, pinned for asynchronous copies to the GPU; with a device
    ``decode``, the workers read the files of its share of the images (and decode the rest), and a
    thread of this process decodes each batch on ``device``, on a side stream, ahead of the training
    loop (training/data/side_stream.py says why the side streams are needed)."""
    if decode is not None:
        encoded = EncodedFolder(folder, decode.share)
        pin = device.type == "cuda"
        batches = image_batches(encoded, keys, settings, backend, pin=pin, collate_fn=collate_encoded)
        return SideStreamBatches(DeviceBatcher(decode.decode, folder, device), streams_for(device))(batches)
    batches = image_batches(folder, keys, settings, backend, pin=device.type == "cuda", collate_fn=collate)
    return (
        (images.to(device, non_blocking=True), labels.to(device, non_blocking=True), skipped)
        for images, labels, skipped in batches
    )


def image_batches(
    dataset: torch.utils.data.Dataset,
    keys: Iterator[list],
    settings: TrainingSettings,
    backend: Backend,
    *,
    pin: bool,
    collate_fn: Callable[[list], Any],
) -> Iterator[Any]:
    """The DataLoader's collated batches, with a worker's error raised here as the worker raised it."""
    workers = default_workers(backend.local_size) if settings.data_workers is None else settings.data_workers
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = {
            # Forked workers can crash on InfiniBand verbs, which are not fork-safe (Horovod's advice).
            "multiprocessing_context": "forkserver",
            "prefetch_factor": 4,
            "worker_init_fn": partial(_init_worker, backend.rank, os.getpid()),
        }
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=keys, num_workers=workers, collate_fn=collate_fn, pin_memory=pin, **extra
    )
    try:
        yield from loader
    except JobError as exc:
        raise worker_error(exc) from None


def worker_error(exc: JobError) -> JobError:
    """The error a DataLoader worker raised, without the worker's traceback that the DataLoader
    writes into the message when it raises the error again in this process."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    last = text.rstrip().splitlines()[-1]  # "training.data.DataDirError: <message>"
    return type(exc)(last.partition(": ")[2])


def _init_worker(rank: int, owner_pid: int, worker_id: int) -> None:
    die_with(owner_pid)  # never outlive the rank (training/world/lifetime.py)
    configure_logging(rank)  # so skipped-image warnings look like the rest of the log
    preemption.ignore()  # an eviction's SIGUSR1 reaches every process of the job: it is the rank's


def settle_auto(
    settings: TrainingSettings,
    plan: DataPlan,
    backend: Backend,
    device: torch.device,
    decode: GpuDecode | None,
    model_steps: Callable[[], Iterator[None]],
) -> GpuDecode | None:
    """``--decode auto`` with a working nvJPEG: the share of the images the GPU decodes, from the rates
    of the CPU loader, the GPU path and the model measured here (training/data/decode_choice.py); the
    largest share any rank needs, so that every rank's loaders keep up; None for none."""
    if settings.decode != "auto" or decode is None or plan.train is None:
        return decode
    train = plan.train
    workers = default_workers(backend.local_size) if settings.data_workers is None else settings.data_workers
    count, warm = probe_batches(workers), warm_batches(workers)

    def loader(with_decode: GpuDecode | None) -> Iterator[Batch]:
        keys = train_keys(
            len(train),
            backend.rank,
            backend.size,
            settings.batch_size,
            settings.seed,
            plan.steps_per_epoch,
            0,
            warm + count,
        )
        return image_loader(train, keys, settings, backend, device, with_decode)

    sync = partial(torch.cuda.synchronize, device) if device.type == "cuda" else lambda: None
    rates = measure_rates(lambda: loader(None), lambda: loader(decode), model_steps, count, sync, warm=warm)
    share = max(backend.allgather_object(rates.gpu_share()))
    chosen = GpuDecode(decode.decode, share) if share > 0 else None
    if backend.rank == 0:
        log.info("--decode auto: %s; decoding with %s", rates, chosen or decoder_name())
    return chosen


def model_steps(settings: TrainingSettings, plan: DataPlan, backend: Backend, model: TrainedModel) -> Iterator[None]:
    """One forward and backward pass of the model as trained, on a synthetic batch, per item: the
    model's rate for ``--decode auto``'s probe. No optimizer step, and no count towards the end of
    the periodic sync's warm-up; when the probe is done the gradients are dropped and the batch-norm
    statistics put back, so training starts as it would have."""
    images, labels = synthetic_batch(
        settings.seed, backend.rank, settings.batch_size, settings.image_size, plan.num_classes
    )
    images_on, labels_on = torch.from_numpy(images).to(model.device), torch.from_numpy(labels).to(model.device)
    saved = [buffer.clone() for buffer in model.module.buffers()]
    uncounted = contextlib.nullcontext if model.periodic is None else model.periodic.uncounted
    try:
        while True:
            with model.autocast():
                loss = F.cross_entropy(model.wrapped(images_on), labels_on)
            with uncounted():
                loss.backward()
            backend.drop_gradients(model.optimizer)
            yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(model.module.buffers(), saved, strict=True):
                buffer.copy_(value)


def train_batches(
    settings: TrainingSettings,
    plan: DataPlan,
    backend: Backend,
    device: torch.device,
    decode: GpuDecode | None,
    start: int,
    total: int,
) -> Iterator[Batch]:
    if plan.train is None:
        # Synthetic: one fixed batch, already on the device, so input costs nothing.
        images, labels = synthetic_batch(
            settings.seed, backend.rank, settings.batch_size, settings.image_size, plan.num_classes
        )
        return repeat((torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device), 0))
    keys = train_keys(
        len(plan.train),
        backend.rank,
        backend.size,
        settings.batch_size,
        settings.seed,
        plan.steps_per_epoch,
        start,
        total,
    )
    return image_loader(plan.train, keys, settings, backend, device, decode)


def make_evaluate(
    settings: TrainingSettings,
    plan: DataPlan,
    backend: Backend,
    model: nn.Module,
    device: torch.device,
    decode: GpuDecode | None,
    autocast: Callable[[], Any],
    skipped: SkipCounter,
) -> Callable[[], tuple[int, int]] | None:
    if plan.val is None:
        return None
    val = plan.val

    @torch.no_grad()
    def evaluate() -> tuple[int, int]:
        # The bare model, not the DDP wrapper: ranks have different numbers of validation
        # batches, and DDP's forward would issue a buffer broadcast per batch.
        model.eval()
        correct = total = 0
        keys = val_keys(len(val), backend.rank, backend.size, settings.batch_size)
        for images, labels, batch_skipped in image_loader(val, keys, settings, backend, device, decode):
            skipped.add(batch_skipped)
            with autocast():
                logits = model(images)
            correct += int((logits.argmax(1) == labels).sum())
            total += len(labels)
        model.train()
        return correct, total

    return evaluate


def job_device(backend: Backend) -> torch.device:
    """The GPU of this process's local rank, made current, or the CPU where there is none."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", backend.local_rank)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    return device


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """A checkpoint's payload: everything a resumed run needs to continue at ``step``."""
    buffer = io.BytesIO()
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        **(extra or {}),
    }
    torch.save(state, buffer)
    return buffer.getvalue()


def periodic_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    periodic: PeriodicSync,
    step: int,
) -> bytes | None:
    """A checkpoint's payload under ``--sync local-sgd|hierarchical``, on rank 0 (None elsewhere):
    :func:`training_state` with every replica added (:meth:`PeriodicSync.checkpoint`, a collective)."""
    extra = periodic.checkpoint(model, optimizer, step)
    return None if extra is None else training_state(model, optimizer, scaler, step, extra)


@dataclass(frozen=True)
class TrainedModel:
    """The model as this rank trains it: built once (:func:`build_trained_model`), used by the steps,
    the ``--decode auto`` probe, checkpoints, evaluation and exports."""

    device: torch.device
    dtype: torch.dtype | None  # autocast's; None: fp32
    module: nn.Module  # the bare model: its state_dict, evaluation, exports
    wrapped: nn.Module  # what the steps call: ``module`` under DDP and/or torch.compile
    optimizer: torch.optim.Optimizer  # Horovod's DistributedOptimizer under Horovod
    scaler: torch.amp.GradScaler  # enabled with float16 only
    periodic: PeriodicSync | None  # --sync local-sgd|hierarchical with more than one process

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None)

    @property
    def precision(self) -> str:
        """As the metrics JSON names it."""
        return "fp32" if self.dtype is None else f"amp_{'bf16' if self.dtype == torch.bfloat16 else 'fp16'}"

    def checkpoint_payload(self, step: int) -> bytes | None:
        """What a checkpoint of ``step`` holds (:func:`training_state`); under the periodic modes every
        replica too (:func:`periodic_state`: a collective, None on ranks other than 0)."""
        if self.periodic is None:
            return training_state(self.module, self.optimizer, self.scaler, step)
        return periodic_state(self.module, self.optimizer, self.scaler, self.periodic, step)


@dataclass(frozen=True)
class Job:
    """Everything this rank builds before its first step (:func:`build_job`), for :func:`run_steps`."""

    backend: Backend
    model: TrainedModel
    run: TrainingRun
    batches: Iterator[Batch]
    skipped: SkipCounter | None  # images the loaders skipped; None with synthetic data (nothing to skip)
    exporter: Exporter
    profile_dir: Path | None
    compute: ComputeClock  # this rank's data + forward + loss per step, for the slow-rank check


def train(settings: TrainingSettings, backend: Backend) -> dict[str, Any]:
    return run_steps(build_job(settings, backend))


def build_trained_model(
    settings: TrainingSettings, backend: Backend, plan: DataPlan, device: torch.device
) -> tuple[TrainedModel, int, Fingerprint]:
    """The model, its optimizer and loss scaler, resumed from the newest checkpoint, distributed and
    compiled; with the step it starts at and its fingerprint."""
    dtype = amp_dtype(settings.precision, device)
    # The input is channels-last, which is enough for cuDNN/oneDNN to pick NHWC kernels; the
    # weights stay contiguous for Horovod, which allreduces only contiguous tensors.
    model = build_model(settings.model, plan.num_classes).to(device)
    sgd = settings.optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    shapes = ((name, tuple(tensor.shape)) for name, tensor in model.state_dict().items())
    fingerprint = Fingerprint.of("pytorch", settings.model, plan.num_classes, shapes)
    start_step, state = resume(settings, backend, fingerprint, plan.total_steps, decode_state)
    if state is not None:
        restore(settings, start_step, lambda: model.load_state_dict(state["model"]))
    sync = settings.sync
    if sync.mode == HIERARCHICAL:
        check_layout(backend.allgather_object(backend.local_size))
    wrapped, optimizer = backend.distribute(model, optimizer, settings.fp16_allreduce)
    # One process has no replicas to average (and no DDP wrapper to hook): every step is then the same.
    periodic = (
        PeriodicSync(sync, wrapped, backend.local_size, start_step) if sync.periodic and backend.size > 1 else None
    )
    if state is not None:
        restore(settings, start_step, lambda: load_training_state(optimizer, scaler, state))
        if periodic is not None:
            restore(settings, start_step, lambda: periodic.restore(model, optimizer, state, backend.rank))
        else:
            restore(settings, start_step, partial(refuse_replicas, state))
    # --compile's default: on with CUDA; on the CPU, compiling takes longer than most runs
    compiled = device.type == "cuda" if settings.compile is None else settings.compile
    if compiled:
        # The DDP wrapper itself, so that its graph is split at the gradient buckets and their
        # all-reduces overlap backward (torch._dynamo's DDPOptimizer).
        wrapped = torch.compile(wrapped)
    return TrainedModel(device, dtype, model, wrapped, optimizer, scaler, periodic), start_step, fingerprint


def build_job(settings: TrainingSettings, backend: Backend) -> Job:
    """This rank's parts, in torchtitan's order: device, data plan, model, the decoder (``--decode auto``
    probes the model as trained), the run's bookkeeping and its batches."""
    device = job_device(backend)
    if backend.rank == 0 and settings.sync.periodic:
        log.info("synchronisation: %s", settings.sync.describe())
    # Ranks start from different random weights on purpose: training only works if the
    # broadcast from rank 0 makes them equal, and the equivalence test checks that it does.
    torch.manual_seed(settings.seed + backend.rank)
    decoder = choose_decoder(settings.decode, device) if settings.data == "imagenet" else None
    decode = None if decoder is None else GpuDecode(decoder)
    plan = agree(backend, lambda: plan_data(settings, backend.size))
    sync = settings.sync
    if backend.rank == 0 and sync.periodic and sync.warmup_steps < plan.total_steps < sync.warmup_steps + sync.every:
        log.warning(
            "--sync-every %d is longer than the run's %d local steps: the replicas are averaged only at the end",
            sync.every,
            plan.total_steps - sync.warmup_steps,
        )
    model, start_step, fingerprint = build_trained_model(settings, backend, plan, device)
    decode = settle_auto(settings, plan, backend, device, decode, partial(model_steps, settings, plan, backend, model))
    skipped = SkipCounter()
    compute = ComputeClock(device)
    exporter = Exporter(
        settings,
        backend,
        ExportSpec.of(settings, plan),
        partial(export_model, model.module, settings.image_size),
    )
    run = TrainingRun(
        settings,
        backend,
        steps_per_epoch=plan.steps_per_epoch,
        total_steps=plan.total_steps,
        start_step=start_step,
        precision=model.precision,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        decoder=None if plan.train is None else str(decode) if decode is not None else decoder_name(),
        fingerprint=fingerprint,
        save_state=model.checkpoint_payload,
        collective_save=model.periodic is not None,
        evaluate=make_evaluate(settings, plan, backend, model.module, device, decode, model.autocast, skipped),
        on_epoch_end=exporter.epoch_hook,
        compute=compute,
    )
    batches = train_batches(settings, plan, backend, device, decode, start_step, run.total_steps)
    reported = skipped if plan.train is not None else None
    return Job(backend, model, run, batches, reported, exporter, settings.profile_dir, compute)


def run_steps(job: Job) -> dict[str, Any]:
    """The training loop: a step per batch while the run has steps; then the run's metrics."""
    model, run = job.model, job.run
    profiler = StepProfiler(job.profile_dir, job.backend.rank, run.excluded)
    model.module.train()
    # the clock spans the wait for each batch, then the forward pass and the loss: what no collective waits in
    for step, (images, labels, batch_skipped) in zip(run.steps(), job.compute.fetching(job.batches), strict=False):
        for group in model.optimizer.param_groups:
            group["lr"] = run.lr(step)
        model.optimizer.zero_grad()  # sets grads to None (the default); Horovod takes no argument
        with model.autocast():
            loss = F.cross_entropy(model.wrapped(images), labels)
        job.compute.end()
        model.scaler.scale(loss).backward()
        job.backend.step(model.optimizer, model.scaler)
        model.scaler.update()
        if model.periodic is not None:
            model.periodic.after_step(step, publish=leaves_run(job, step))
        if job.skipped is not None:
            job.skipped.add(batch_skipped)
        run.step_done(step, loss.item)
        profiler.step()
    profiler.stop()
    metrics = run.finish(job.skipped)
    job.exporter.final(metrics)
    return metrics


def leaves_run(job: Job, step: int) -> bool:
    """Whether the model leaves the run after 0-based ``step``: the final checkpoint and export, or an
    epoch's export (``--export-every-epoch``). The periodic modes make their replicas one model then."""
    done = step + 1
    epoch_export = job.exporter.epoch_hook is not None and done % job.run.steps_per_epoch == 0
    return done == job.run.total_steps or epoch_export


def export_model(model: nn.Module, image_size: int, directory: Path) -> ModelFiles:
    """``model.pt2`` (torch.export: uint8 NHWC images in, logits out, any batch size). It is the only copy
    of the weights: ``torch.export.load(path).state_dict`` is the model's own state_dict (same names),
    for ``training.torch.models.build_model(...).load_state_dict``.

    ``model`` is the bare module (never the DDP wrapper or the compiled one). The export is taken
    from a float32 copy on the CPU in eval mode (batch norm with its running statistics), so it
    loads on any machine, and the model in training keeps its device, mode and layout. torch.export
    traces every model of training.torch.models (a test exports each), so no TorchScript fallback.
    """
    # Contiguous weights: torch.export.save warns about channels-last ones (DDP's layout).
    frozen = copy.deepcopy(model).cpu().float().to(memory_format=torch.contiguous_format).eval()
    example = torch.zeros(2, image_size, image_size, 3, dtype=torch.uint8)
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(frozen, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, directory / "model.pt2")
    return ModelFiles("torch.export", "model.pt2", "logits")


def load_training_state(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, state: dict[str, Any]) -> None:
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])


def decode_state(payload: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def start_backend(settings: TrainingSettings) -> Backend:
    if problem := refusal(settings):  # before any process group: one line, exit 2
        raise BadInput(problem, every_rank=True)
    return HorovodBackend() if settings.backend == "horovod" else DDPBackend()


def refusal(settings: TrainingSettings) -> str | None:
    """Why this job cannot train these settings, or None: what only training.model_parallel does yet.
    (Issue 45 makes the two trainers one; until then each refuses what the other one does.)"""
    mesh_job = "torchrun --nproc-per-node N -m training.model_parallel, with the same flags"
    if settings.parallel.mesh:
        return f"{settings.parallel.flags()}: a mesh layout (--tp, --pp, --dp-shard) runs under {mesh_job}"
    if settings.parallel.activation_checkpointing != AUTO:
        return f"--activation-checkpointing is for mesh layouts: {mesh_job}"
    if settings.gpt is not None:
        return f"--model {settings.model}: the transformers train under {mesh_job}"
    if settings.optimizer.name != SGD:
        return f"--optimizer {settings.optimizer.name}: this job trains with SGD; AdamW runs under {mesh_job}"
    return None


def main(argv: Sequence[str] | None = None) -> NoReturn:
    run_job("pytorch", argv, start_backend, train)


if __name__ == "__main__":
    main()
