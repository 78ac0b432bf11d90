"""Model-parallel training: ``torchrun --nproc-per-node N -m training.model_parallel [flags]``.

The world's ranks form one DeviceMesh ``(pp, dp_replicate, dp_shard, tp)`` (see
:mod:`training.config.layout`): ``--tp`` tensor-parallel ranks split each transformer block,
``--pp`` pipeline stages split the layers, ``--dp-shard`` ranks shard parameters, gradients and
optimizer state (FSDP2), and the ranks left over replicate. ``--batch-size`` is the batch of one
data-parallel replica (a TP group, or a whole pipeline, is one replica).

Every layout trains the same model on the same data, step for step: the full model is built from
``--seed`` in every process, then split and sharded (models too big for that are built on the meta
device and initialized after sharding); a step's global batch depends only on ``(seed, step)``,
and replicas take disjoint slices of it. The loss is the cross-entropy's mean over the replica's
batch (over microbatches in a pipeline, whose schedule scales the gradients to match); FSDP
averages gradients over the replicas. So one process and any layout see the same losses, up to
the order of floating-point sums (tests/training/test_mp_equivalence.py).

The optimizer is ``--optimizer``: by default AdamW for the transformers (betas 0.9/0.95, ``--weight-decay``
0.1 on every parameter, GPT-3's and Llama's settings; no gradient clipping) at a constant ``--lr``, fused
(one kernel for the whole step) where every parameter is on a GPU, and SGD for the ResNets, with the
data-parallel job's LR schedule (training/run/schedule.py).

The flags are training.pytorch's (one parser, training/config/args.py) and become the one frozen
:class:`~training.config.settings.TrainingSettings` right after parsing (:func:`parse_settings`); every
function here takes it, and the run trains with its copy resolved for the device (:func:`for_device`).
What only training.pytorch does (ImageNet, local SGD, Horovod, ``--precision amp`` ...) is refused here
in one line before any process group starts (:func:`refusal`), until the two trainers are one.

Speed on a GPU (docs/performance.md): each block is compiled (``--compile``, the default with
CUDA), activation checkpointing is on only when the memory estimate says the model would not
fit (``--activation-checkpointing auto``), one process trains the plain model under autocast
(no FSDP), and the host waits for the device only where a number is read: timing edges, log
steps, checkpoints and the end. Errors and exit statuses are those
of the other jobs (:mod:`training.run.job`); a layout that cannot work is refused before any process
group starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from training.checkpoint.sharded import ShardedCheckpoints
from training.config.activation_checkpointing import AUTO
from training.config.args import ADAMW, log_interval
from training.config.layout import Layout, check_model
from training.config.models import GPT_CONFIGS, RESNETS, SYNTHETIC_CLASSES, GPTConfig, flops_per_token, parameter_count
from training.config.pipeline_schedules import check_microbatches, theoretical_bubble
from training.config.settings import TrainingSettings
from training.config.settings import parse_settings as parse_job_settings
from training.data.imagenet import sampled_epochs, synthetic_batch
from training.data.text import TokenSource, replica_rows, token_source
from training.errors import BadInput, CheckpointRefused, JobError
from training.pytorch import DDPBackend
from training.run import curves, tracking
from training.run.job import run_job
from training.run.metrics import RateWindow, StepTimer, throughput, write_metrics
from training.run.outputs import output_error
from training.run.schedule import learning_rate
from training.run.slow_ranks import SlowRankWatch, hostname
from training.torch.compute_clock import ComputeClock
from training.torch.models import build_model
from training.torch.parallel import memory
from training.torch.parallel.export import gather_full_state_dict, write_whole_model
from training.torch.parallel.mesh import build_mesh
from training.torch.parallel.pipeline import LossFn, Pipeline, build_pipeline, split_for_pipeline
from training.torch.parallel.sharding import autocasts, parallelize
from training.torch.profiling import StepProfiler
from training.torch.transformer import build_gpt, init_weights
from training.world.distributed import set_failure_timeouts
from training.world.preemption import PreemptionWatch, stop

log = logging.getLogger(__name__)

PROG = "torchrun --nproc-per-node N -m training.model_parallel"
MODELS = (*GPT_CONFIGS, *RESNETS)  # what a mesh splits: transformer layers, residual blocks
# Past this, the fp32 model is not built whole in every process (llama-8b would need 32 GB per
# rank): it is created on the meta device, sharded, then initialized shard by shard.
META_INIT_BYTES = 2 * 2**30
METRIC_KEYS = (
    "framework",
    "job",
    "model",
    "world_size",
    "layout",
    "pp_schedule",
    "microbatches",
    "activation_checkpointing",
    "compiled",
    "batch_size_per_replica",
    "global_batch_size",
    "seq_len",
    "steps",
    "warmup_steps_excluded",
    "resumed_from_step",
    "step_losses",
    "final_loss",
    "parameters_total",
    "parameters_per_rank",
    "parameter_bytes_per_rank",
    "peak_memory_bytes_per_rank",
    "tokens_per_sec",
    "images_per_sec",
    "mfu",
    "bubble_fraction",
    "bubble_fraction_theory",
    "precision",
    "device",
)


def parse_settings(argv: Sequence[str] | None = None) -> TrainingSettings:
    """The job's settings, built once from the flags by the PyTorch jobs' one parser (exit 2 on a bad flag)."""
    return parse_job_settings("pytorch", argv, prog=PROG)


def refusal(settings: TrainingSettings) -> str | None:
    """Why this job cannot train these settings, or None: what only training.pytorch does yet.
    (Issue 45 makes the two trainers one; until then each refuses what the other one does.)"""
    data_parallel = "python -m training.pytorch (horovodrun, or torchrun with --backend ddp)"
    if settings.model not in MODELS:
        return f"--model {settings.model}: a mesh splits the transformers and ResNets; it trains under {data_parallel}"
    if settings.data == "imagenet":
        return f"--data imagenet: this job trains on synthetic data and text; ImageNet runs under {data_parallel}"
    if settings.precision == "amp":
        return "--precision amp: a mesh layout computes in bf16 (--precision bf16)"
    only_there = {
        f"--sync {settings.sync.mode}": settings.sync.periodic,
        "--fp16-allreduce": settings.fp16_allreduce,
        "--ignore-bad-checkpoints": settings.ignore_bad_checkpoints,
        "--export-every-epoch": settings.export_every_epoch,
    }
    given = [flag for flag, on in only_there.items() if on]
    if given:
        return f"{', '.join(given)}: data-parallel only, under {data_parallel}"
    return None


def model_shape(settings: TrainingSettings) -> tuple[int, int | None, int | None]:
    """(layers or residual blocks, attention heads, key/value heads) of ``--model``."""
    cfg = settings.gpt
    if cfg is not None:
        return cfg.n_layers, cfg.n_heads, cfg.kv_heads
    with torch.device("meta"):
        resnet = build_model(settings.model, classes(settings))
    return len(resnet.layers) - 5, None, None  # [Normalize, stem, blocks..., pool, flatten, fc]


def classes(settings: TrainingSettings) -> int:
    """The ResNets' classifier width: ``--num-classes``, or synthetic images' default."""
    return settings.num_classes or SYNTHETIC_CLASSES


def layout_of(settings: TrainingSettings, world_size: int) -> Layout:
    """The layout the flags ask for; :class:`BadInput` if the world or the model cannot take it.
    Without ``--dp-shard`` this job shards over every rank left (-1)."""
    parallel = settings.parallel
    dp_shard = -1 if parallel.dp_shard is None else parallel.dp_shard
    layout = Layout.from_flags(world_size, parallel.tp, parallel.pp, dp_shard)
    units, heads, kv_heads = model_shape(settings)
    check_model(layout, settings.model, units, heads, kv_heads, parallel.stages_per_rank)
    if layout.pp > 1:
        assert parallel.microbatches is not None and parallel.pp_schedule is not None, "filled in by the parser"
        check_microbatches(parallel.microbatches, layout.pp, parallel.pp_schedule, settings.batch_size)
    return layout


def start(settings: TrainingSettings) -> DDPBackend:
    if "RANK" not in os.environ:
        raise BadInput(
            "training.model_parallel runs under torchrun: torchrun --nproc-per-node N -m training.model_parallel ..."
        )
    if problem := refusal(settings):
        raise BadInput(problem, every_rank=True)
    try:  # a bad layout is refused before any process group starts
        layout_of(settings, int(os.environ["WORLD_SIZE"]))
    except BadInput as exc:  # every rank finds it: rank 0 alone says so
        raise BadInput(str(exc), every_rank=True) from None
    return DDPBackend()


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, mean over every token (or image) of the batch or microbatch."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


@dataclass
class Parts:
    """This rank's share of the model: its chunks (one, or a pipeline's virtual stages), one
    optimizer per chunk, and the pipeline schedule that drives them (None without ``--pp``)."""

    chunks: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    optimizers: list[torch.optim.Optimizer]
    pipeline: Pipeline | None = None
    parameters_total: int = 0
    loss: LossFn = loss_fn
    autocast_device: str | None = None  # bf16 autocast on this device type (one process), else None

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, forward_done: Callable[[], None] | None = None
    ) -> torch.Tensor | None:
        """One optimizer step; the loss on ranks that compute it (a pipeline's last stage), else None.
        ``forward_done``: called once the loss is computed (without a pipeline, whose forward and backward
        passes interleave)."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        if self.pipeline is not None:
            loss = self.pipeline.step(inputs if self.first else None, targets if self.last else None)
        else:
            device_type = self.autocast_device or "cpu"
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.autocast_device is not None):
                loss = self.loss(self.chunks[0](inputs), targets)
            if forward_done is not None:
                forward_done()
            loss.backward()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss


def build_full_model(settings: TrainingSettings) -> nn.Module:
    """The whole model, with the same weights in every process (on the meta device when too big)."""
    cfg = settings.gpt
    if cfg is None:
        torch.manual_seed(settings.seed)  # ResNet's init draws from the global generator
        return build_model(settings.model, classes(settings))
    return build_gpt(cfg, None if parameter_count(cfg) * 4 > META_INIT_BYTES else settings.seed)


def split(model: nn.Module, layout: Layout, pp_rank: int, schedule: str | None) -> tuple[list[nn.Module], list[int]]:
    if layout.pp == 1:
        return [model], [0]
    assert schedule is not None, "filled in by the parser with --pp"
    return split_for_pipeline(model, pp_rank, layout.pp, schedule)


def materialize(chunk: nn.Module, cfg: GPTConfig | None, seed: int, device: torch.device) -> None:
    """Allocate and initialize a chunk built on the meta device, after sharding (each rank fills its
    shards; the values depend on the layout, unlike a model built whole)."""
    if not any(param.is_meta for param in chunk.parameters()):
        return
    assert cfg is not None, "only transformers are built on the meta device"
    chunk.to_empty(device=device)
    torch.manual_seed(seed)
    init_weights(chunk, cfg.n_layers)


def build_optimizer(chunk: nn.Module, settings: TrainingSettings) -> torch.optim.Optimizer:
    """``--optimizer`` over ``chunk``: AdamW fused where every parameter is on a GPU (foreach elsewhere),
    SGD with momentum; its LR is set before every step (:meth:`Run.lr`)."""
    params = list(chunk.parameters())
    fused = bool(params) and all(param.device.type == "cuda" for param in params)
    choice = settings.optimizer
    if choice.name == ADAMW:
        return torch.optim.AdamW(
            params, lr=choice.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=choice.weight_decay, fused=fused or None
        )
    return torch.optim.SGD(params, lr=choice.lr, momentum=choice.momentum or 0.0, weight_decay=choice.weight_decay)


def build_parts(settings: TrainingSettings, layout: Layout, mesh: DeviceMesh, rank: int, device: torch.device) -> Parts:
    """Build, split, shard (TP, activation checkpointing, compile, FSDP) and wrap in a pipeline: this rank's parts."""
    model = build_full_model(settings)
    total = sum(param.numel() for param in model.parameters())
    parallel = settings.parallel
    chunks, stage_ids = split(model, layout, layout.coordinates(rank)["pp"], parallel.pp_schedule)
    del model  # the layers of other stages go with it
    cfg = settings.gpt
    for chunk in chunks:
        if not any(param.is_meta for param in chunk.parameters()):
            chunk.to(device)
        parallelize(chunk, layout, mesh, settings.precision, parallel.activation_checkpointing, settings.compile)
        materialize(chunk, cfg, settings.seed, device)
    optimizers = [build_optimizer(chunk, settings) for chunk in chunks]
    num_stages = layout.pp * parallel.stages_per_rank
    # Compiled, the cross-entropy never materializes the fp32 copy of the logits (as torchtitan does).
    loss = torch.compile(loss_fn, fullgraph=True, dynamic=False) if settings.compile else loss_fn
    amp = device.type if autocasts(layout, settings.precision) else None
    parts = Parts(chunks, stage_ids, num_stages, optimizers, parameters_total=total, loss=loss, autocast_device=amp)
    if layout.pp > 1:
        group = mesh["pp"].get_group()
        parts.pipeline = build_pipeline(
            chunks, stage_ids, num_stages, group, device, parallel.pp_schedule, parallel.microbatches, loss
        )
    return parts


class Batches:
    """This replica's inputs and targets for a step, on the device."""

    def __init__(self, settings: TrainingSettings, replica: int, device: torch.device) -> None:
        self.settings, self.replica, self.device = settings, replica, device
        self.tokens: TokenSource | None = None
        self.images: tuple[torch.Tensor, torch.Tensor] | None = None
        cfg = settings.gpt
        if cfg is not None:
            self.tokens = token_source(
                settings.data, settings.data_dir, settings.seed, cfg.vocab_size, settings.seq_len
            )
        else:
            # One fixed batch of synthetic images, already on the device (as the data-parallel job).
            images, labels = synthetic_batch(
                settings.seed, replica, settings.batch_size, settings.image_size, classes(settings)
            )
            self.images = torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)

    def __call__(self, step: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.images is not None:
            return self.images
        assert self.tokens is not None
        tokens = self.tokens.batch(step, replicas * self.settings.batch_size, self.settings.seq_len)
        rows = self.to_device(replica_rows(tokens, self.replica, self.settings.batch_size))
        return rows[:, :-1], rows[:, 1:]  # inputs and targets: views of the one upload

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A blocking copy from pageable memory waits for every kernel queued before it: from pinned
        memory, non-blocking, the host goes on queueing the next step. The rows are uploaded whole
        (contiguous), so the pinned buffer is the one the copy engine reads; a strided view would be
        gathered into pageable memory first."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


def mean_loss(loss: torch.Tensor | None, device: torch.device) -> float:
    """The global batch's loss: the mean of the replicas' losses (collective: every rank calls it).
    Ranks without a loss (early pipeline stages) add nothing; TP ranks add equal copies."""
    if torch.distributed.get_world_size() == 1 and loss is not None:  # one process: no collective
        return float(loss.detach())
    total = torch.zeros(2, dtype=torch.float64, device=device)
    if loss is not None:
        total[0], total[1] = loss.detach().double(), 1.0
    torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


def open_checkpoints(settings: TrainingSettings) -> ShardedCheckpoints | None:
    return (
        ShardedCheckpoints(settings.checkpoint_dir, keep=settings.keep_checkpoints) if settings.checkpoint_dir else None
    )


def resume(
    settings: TrainingSettings,
    backend: DDPBackend,
    checkpoints: ShardedCheckpoints | None,
    parts: Parts,
    steps: int,
) -> int:
    """The step to start from: rank 0 picks the newest complete checkpoint, every rank loads its
    share of it (resharded to this layout); 0 without one."""
    path = checkpoints.agreed_latest() if checkpoints is not None else None
    if checkpoints is None or path is None:
        return 0
    extra = checkpoints.load(path, parts.chunks, parts.optimizers, expect={"model": settings.model})
    step = int(extra["step"])
    if step > steps:
        raise CheckpointRefused(
            f"checkpoint {path} is at step {step}, past this run's --steps {steps}: raise --steps to continue it",
            every_rank=True,
        )
    if backend.rank == 0:
        log.info("resumed from %s at step %d (saved by %s)", path, step, Layout(**extra["layout"]))
    return step


class Run:
    """The step loop and its bookkeeping: logs, checkpoints, timing, the metrics at the end."""

    def __init__(self, settings: TrainingSettings, backend: DDPBackend, layout: Layout, device: torch.device) -> None:
        self.settings, self.backend, self.layout, self.device = settings, backend, layout, device
        assert settings.resolved, "the run trains with for_device(settings, ...)"
        self.cfg = settings.gpt
        self.steps_per_epoch, self.total_steps = sampled_epochs(settings.steps, settings.epochs)
        self.log_every = log_interval(settings.log_every, self.total_steps)
        torch.manual_seed(settings.seed)
        timeout = timedelta(seconds=int(set_failure_timeouts()["DDP_TIMEOUT_SECONDS"]))
        self.parts = build_parts(settings, layout, build_mesh(layout, device.type, timeout), backend.rank, device)
        self.checkpoints = open_checkpoints(settings)
        self.start_step = resume(settings, backend, self.checkpoints, self.parts, self.total_steps)
        self.preemption = PreemptionWatch(backend)
        self.batches = Batches(settings, layout.dp_rank(backend.rank), device)
        # At least one measured step whenever a step runs, so short runs still report a rate.
        self.timer = StepTimer(min(settings.timing_warmup_steps, max(self.total_steps - self.start_step - 1, 0)))
        self.losses: list[list[float | int | None]] = []
        self.bubbles: list[float] = []
        self.window = RateWindow(settings.batch_size * layout.dp * (settings.seq_len if self.cfg is not None else 1))
        self.curves = curves.RunCurves(
            settings.tensorboard_dir,
            settings.summary_png,
            backend.rank,
            self.start_step,
            "tokens" if self.cfg else "images",
        )
        # The same on every rank: memory per rank is gathered (a collective) only for the curves.
        self.memory_curves = (
            settings.tensorboard_dir is not None or settings.summary_png is not None or tracking.enabled()
        )
        # each rank's batch + forward + loss per step, judged by rank 0 at log steps (training/run/slow_ranks.py)
        self.compute = ComputeClock(device)
        self.host = hostname()
        self.slow = (
            SlowRankWatch(settings.slow_ranks_json, why_not=unchecked_layout(layout)) if backend.rank == 0 else None
        )

    def train(self) -> dict[str, Any]:
        settings = self.settings
        if self.backend.rank == 0:
            log.info(
                "%s on %s (world %d): batch %d per replica x %d, %d parameters, steps %d to %d",
                settings.model, self.layout, self.backend.size, settings.batch_size, self.layout.dp,
                self.parts.parameters_total, self.start_step + 1, self.total_steps,
            )  # fmt: skip
        loss = None
        profiler = StepProfiler(settings.profile_dir, self.backend.rank, self.timer.excluded)
        for step in range(self.start_step, self.total_steps):
            self.set_lr(step)
            self.compute.begin()
            loss = self.parts.step(*self.batches(step, self.layout.dp), forward_done=self.compute.end)
            if self.reads_numbers(step + 1):
                sync(self.device)  # the clock, the loss and the checkpoint must see finished work
            self.timer.step_done()
            self.step_done(step + 1, loss)
            profiler.step()
        profiler.stop()
        final = mean_loss(loss, self.device) if self.total_steps > self.start_step else None
        self.preemption.close()
        return self.finish(final)

    def lr(self, step: int) -> float:
        """The LR of the step with 0-based index ``step``: constant with AdamW's defaults, Goyal et al.'s
        schedule with SGD's (its replicas: the layout's data-parallel ones)."""
        choice = self.settings.optimizer
        scale = choice.lr_scale(self.layout.dp)
        return learning_rate(step, self.steps_per_epoch, choice.lr, scale, choice.warmup_epochs, choice.lr_decay_epochs)

    def set_lr(self, step: int) -> None:
        lr = self.lr(step)
        for optimizer in self.parts.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def reads_numbers(self, done: int) -> bool:
        """Whether step ``done`` ends where the host reads the device: the end of the timing warmup,
        a log step, a checkpoint, the last step. Between them the host runs ahead."""
        every = self.settings.checkpoint_every
        return (
            done - self.start_step == self.timer.excluded
            or done == self.total_steps
            or done % self.log_every == 0
            or (self.checkpoints is not None and bool(every) and done % every == 0)
        )

    def step_done(self, done: int, loss: torch.Tensor | None) -> None:
        pipeline = self.parts.pipeline
        if pipeline is not None and pipeline.last_bubble_fraction is not None and self.timer.measured_steps:
            self.bubbles.append(pipeline.last_bubble_fraction)  # after the timing warmup, as tokens/s
        if done - self.start_step == self.timer.excluded:
            self.compute.take_window()  # the warmup's steps (compilation, autotuning) are no one's slowness
        if done % self.log_every == 0:
            self.log(done, mean_loss(loss, self.device))  # collective: every rank logs at the same steps
        every = self.settings.checkpoint_every
        save_due = self.checkpoints is not None and (done == self.total_steps or bool(every and done % every == 0))
        if save_due:
            self.timer.pause()
            self.save(done)
            self.timer.resume()
        if self.preemption.agreed():
            if self.checkpoints is not None and not save_due:
                self.save(done)
            raise stop(done, saved=self.checkpoints is not None)

    def log(self, done: int, loss: float) -> None:
        self.losses.append([done, loss if math.isfinite(loss) else None])
        rate = self.window.rate(self.timer)
        values = {curves.LOSS: loss, curves.LR: self.lr(done - 1), self.curves.rate_tag: rate}
        # each rank's compute and host for the slow-rank check, and its peak memory for the curves: one gather
        span = self.compute.take_window() if self.timer.measured_steps else None  # None: a warmup step's
        mine = (
            span,
            self.host,
            memory.peak_memory_bytes(self.device) if self.memory_curves else 0,
        )
        spans, hosts, peaks = zip(*self.backend.allgather_object(mine), strict=True)
        if self.memory_curves:
            values.update({curves.MEMORY_GIB.format(rank=rank): peak / 2**30 for rank, peak in enumerate(peaks)})
        if self.backend.rank == 0:
            shown = "" if rate is None else f" {self.curves.unit}/s {rate:.1f}"
            log.info("step %d/%d loss %.4f%s", done, self.total_steps, loss, shown)
            self.curves.record(done, values)
            assert self.slow is not None
            self.slow.observe(done, spans, hosts)

    def save(self, step: int) -> None:
        assert self.checkpoints is not None
        extra = {
            "step": step,
            "model": self.settings.model,
            "layout": self.layout.as_dict(),
            "seed": self.settings.seed,
        }
        path = self.checkpoints.save(step, self.parts.chunks, self.parts.optimizers, extra)
        if self.backend.rank == 0:
            log.info("saved checkpoint %s", path)

    def finish(self, final_loss: float | None) -> dict[str, Any]:
        """Gather every rank's numbers; rank 0 writes ``--metrics-json``. Raises :class:`JobError`
        after writing them if the loss is not finite."""
        count, size = memory.local_parameters(self.parts.chunks)
        bubble = sum(self.bubbles) / len(self.bubbles) if self.bubbles else None
        mine = (self.timer.elapsed, count, size, memory.peak_memory_bytes(self.device), bubble)
        fields = ("elapsed", "count", "bytes", "peak", "bubble")
        ranks = [dict(zip(fields, values, strict=True)) for values in self.backend.allgather_object(mine)]
        diverged = final_loss is not None and not math.isfinite(final_loss)
        metrics = self.metrics(None if diverged else final_loss, ranks)
        if self.backend.rank == 0:
            log.info("metrics: %s", {key: value for key, value in metrics.items() if key != "step_losses"})
            if self.settings.metrics_json is not None:
                try:
                    write_metrics(self.settings.metrics_json, metrics, METRIC_KEYS)
                except OSError as exc:
                    raise output_error("--metrics-json", self.settings.metrics_json, exc) from None
        if not diverged:
            self.export(metrics)
        self.finish_curves(final_loss, metrics)
        if diverged:
            raise JobError(f"training diverged: the final loss is {final_loss}", every_rank=True)
        return metrics

    def export(self, metrics: dict[str, Any]) -> None:
        """``--export-dir``: the whole model, gathered from every shard and stage (collective)."""
        if self.settings.export_dir is None:
            return
        state = gather_full_state_dict(self.parts.chunks, self.layout, self.backend.rank)
        if state is not None:  # rank 0
            try:
                write_whole_model(self.settings, state, metrics)
            except OSError as exc:
                raise output_error("--export-dir", self.settings.export_dir, exc) from None
            log.info("exported the whole model to %s", self.settings.export_dir)
        self.backend.allgather_object(None)  # the other ranks wait for it, as for a checkpoint

    def finish_curves(self, final_loss: float | None, metrics: dict[str, Any]) -> None:
        final = {self.curves.final_rate_tag: metrics["tokens_per_sec"] or metrics["images_per_sec"]}
        if self.total_steps % self.log_every:  # the last step was not logged: end the loss curve there
            final[curves.LOSS] = final_loss
        model, batch = self.settings.model, self.settings.batch_size
        title = f"{model} on {self.layout} (world size {self.backend.size}), batch {batch} per replica"
        self.curves.finish(self.total_steps, final, title)

    def metrics(self, final_loss: float | None, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        settings, layout, cfg = self.settings, self.layout, self.cfg
        parallel = settings.parallel
        global_batch = settings.batch_size * layout.dp
        per_step = global_batch * (settings.seq_len if cfg is not None else 1)
        rate, _ = throughput(per_step, self.timer.measured_steps, [rank["elapsed"] for rank in ranks])
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        bubbles = [rank["bubble"] for rank in ranks if rank["bubble"] is not None]
        pipelined = layout.pp > 1
        metrics = {
            "framework": "pytorch",
            "job": "model_parallel",
            "model": settings.model,
            "world_size": self.backend.size,
            "layout": layout.as_dict(),
            "pp_schedule": parallel.pp_schedule if pipelined else None,
            "microbatches": parallel.microbatches if pipelined else None,
            "activation_checkpointing": parallel.activation_checkpointing,
            "compiled": settings.compile,
            "batch_size_per_replica": settings.batch_size,
            "global_batch_size": global_batch,
            "seq_len": settings.seq_len if cfg is not None else None,
            "steps": self.total_steps,
            "warmup_steps_excluded": self.timer.excluded if self.timer.measured_steps else 0,
            "resumed_from_step": self.start_step or None,
            "step_losses": self.losses,
            "final_loss": final_loss,
            "parameters_total": self.parts.parameters_total,
            "parameters_per_rank": [rank["count"] for rank in ranks],
            "parameter_bytes_per_rank": [rank["bytes"] for rank in ranks],
            "peak_memory_bytes_per_rank": [rank["peak"] for rank in ranks],
            "tokens_per_sec": rate if cfg is not None else None,
            "images_per_sec": rate if cfg is None else None,
            "mfu": memory.mfu(rate, flops_per_token(cfg, settings.seq_len), device, len(ranks)) if cfg else None,
            "bubble_fraction": sum(bubbles) / len(bubbles) if bubbles else None,
            "bubble_fraction_theory": (
                theoretical_bubble(layout.pp, parallel.microbatches, parallel.pp_schedule)
                if pipelined and parallel.microbatches and parallel.pp_schedule
                else None
            ),
            "precision": settings.precision,
            "device": device,
        }
        return {key: metrics[key] for key in METRIC_KEYS}


def unchecked_layout(layout: Layout) -> str | None:
    """Why the slow-rank check cannot compare this layout's ranks; None where it can. It compares the ranks'
    forward passes, which are their own only where no rank waits for another in them: pure replication."""
    if layout.world_size == 1 or (layout.tp, layout.pp, layout.dp_shard) == (1, 1, 1):
        return None
    return (
        f"on {layout} each rank's forward pass waits for others (FSDP's all-gathers, tensor parallel's reductions, "
        "the pipeline's activations), so a slow rank slows its group alike; ranks are compared under pure "
        "replication (--dp-shard 1, no --tp or --pp)"
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def for_device(settings: TrainingSettings, layout: Layout, device: torch.device) -> TrainingSettings:
    """A copy of ``settings`` with ``--compile`` (default: on with CUDA) and ``--activation-checkpointing auto``
    (from the memory estimate) resolved for ``device``: the run trains, and its metrics report, with that one."""
    parallel = settings.parallel
    checkpointing = memory.choose_activation_checkpointing(
        parallel.activation_checkpointing,
        settings.gpt,
        layout,
        settings.batch_size,
        settings.seq_len,
        settings.precision,
        memory.device_memory_bytes(device),
    )
    compile_blocks = device.type == "cuda" if settings.compile is None else settings.compile
    return dataclasses.replace(
        settings,
        compile=compile_blocks,
        parallel=dataclasses.replace(parallel, activation_checkpointing=checkpointing),
    )


def train(settings: TrainingSettings, backend: DDPBackend) -> dict[str, Any]:
    device = torch.device("cuda", backend.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    layout = layout_of(settings, backend.size)
    resolved = for_device(settings, layout, device)
    if settings.parallel.activation_checkpointing == AUTO and backend.rank == 0:
        chosen = resolved.parallel.activation_checkpointing
        log.info("activation checkpointing: %s (auto, from the memory estimate)", chosen)
    return Run(resolved, backend, layout, device).train()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    run_job("pytorch", argv, start, train, parse=parse_settings)


if __name__ == "__main__":
    main()
