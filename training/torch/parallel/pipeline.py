"""Pipeline parallelism: split a model into stages, run a ``torch.distributed.pipelining`` schedule,
and measure the schedule's bubble.

Splitting (:func:`split_for_pipeline`)
    The transformer (:class:`training.torch.transformer.GPT`) is split between its layers: the token
    embeddings go with the first stage, the final norm and the output projection with the last.
    The ResNets of :mod:`training.torch.models` are split between residual blocks: the input
    normalization and the stem go with the first stage; pooling, flatten and the classifier with
    the last. A chunk is a new module object of the model's own class that holds only its part,
    under the original names (``layers.3.attention.wq.weight`` stays that in every layout), so
    state-dict keys, and therefore checkpoints, are the same whatever the layout. Chunks share
    their submodules with the model they came from: nothing is copied.

    gpipe and 1f1b give each rank one stage; interleaved-1f1b gives each rank ``virtual_stages``
    (default 2) stages, looped: rank r holds stages r, r + pp, r + 2 pp, ... (the placement
    ``torch.distributed.pipelining`` assumes).

Balancing: by parameter count
    The split minimizes the parameter count of the heaviest stage over contiguous splits (ties go
    to the split with the smaller sum of squares), counting the embeddings/stem in the first
    unit and the norm/output/head in the last. Why parameters and not measured time: the split is
    a pure function of the model's shapes, so every rank computes the same split with no
    measuring pass, on any device, with the model still on the meta device, and a checkpoint's
    layout is reproducible; the transformer's layers are identical, so there parameter count is
    time, and it is memory, which is what limits the big models. (The embedding table weighs like
    the output matrix but its lookup costs almost no time, so the first stage may get a layer less
    than time alone would give it.) What it gets wrong is ResNet: early blocks run at high resolution, so they
    cost far more time per parameter. ResNet-50's first group of blocks (56x56) holds 0.8% of the
    parameters and 16% of the FLOPs, its last group (7x7) 59% and 20%; a 2-stage parameter split
    gives the first stage 14 of the 16 blocks and 89% of the FLOPs (4 stages: 75% on the first),
    so the first stage is the bottleneck. A time-balanced split would need a timing pass per
    model, device and batch shape, agreed on by all ranks; the transformer is what the pipeline
    is for.

Running (:func:`build_pipeline`, :class:`Pipeline`)
    The loss function returns the mean over a microbatch, and the schedules scale gradients by
    1/microbatches (``scale_grads=True``), so with equal microbatches the gradient and the returned
    loss (the mean of the microbatch losses) equal those of the whole batch in one pass.

Bubble measurement (:attr:`Pipeline.last_bubble_fraction`)
    Each rank times its busy spans: the stages' ``forward_one_chunk``, ``backward_one_chunk`` and
    the loss, which is where a stage computes; waiting for activations or gradients from a
    neighbour happens outside them. It also times the whole ``step``. After the step the ranks of
    the pipeline exchange (busy, wall) in one small all-gather, and

        bubble = 1 - sum of busy over the pp ranks / (pp x the longest wall time)

    which is the idle share of the pipeline's rank-seconds. Using the longest wall rather than
    each rank's own matters: in GPipe the last stage finishes one backward earlier than the first,
    so its own ratio understates the bubble. Theory (equal stages, no communication cost):
    (p - 1) / (m + p - 1) for gpipe and 1f1b, (p - 1) / (v m + p - 1) for interleaved with v
    stages per rank. Busy time includes collectives that run inside a stage's compute (FSDP
    all-gathers, TP reductions); the bubble is the pipeline's idle time, not communication in
    other mesh dimensions. Idle is everything else: waiting, and the schedule's own work between
    chunks (Python bookkeeping, posting sends and receives: about 1 ms per microbatch on the CI
    machine), which the formula leaves out. On CPU the spans are ``time.perf_counter`` intervals;
    on CUDA they are CUDA events on the current stream, read after a synchronize at the end of the
    step. The first step also infers the stages' shapes, so its bubble is not representative.
    :func:`training.torch.parallel.pipeline_check.measure_bubbles` runs the measurement on equal stages
    (of fixed time, or of fixed FLOPs) for ``make bench`` and the tests; docs/parallelism.md
    ("Pipeline bubble") has the numbers.
"""

from __future__ import annotations

import copy
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from training.config.pipeline_schedules import check_microbatches, stages_per_rank
from training.errors import BadInput
from training.torch.models import BasicBlock, Bottleneck, ResNet

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- splitting


def split_for_pipeline(
    model: nn.Module, pp_rank: int, pp_size: int, schedule: str, *, virtual_stages: int | None = None
) -> tuple[list[nn.Module], list[int]]:
    """This rank's chunks of ``model`` and their global stage indices (ascending).

    Raises :class:`BadInput` when the pipeline has more stages than the model has layers/blocks.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is not in [0, {pp_size})")
    per_rank = stages_per_rank(schedule, virtual_stages)
    bounds = stage_bounds(model, pp_size * per_rank, _stages_hint(pp_size, per_rank, schedule))
    stage_ids = [pp_rank + k * pp_size for k in range(per_rank)]
    chunks = [_make_chunk(model, bounds, stage) for stage in stage_ids]
    return chunks, stage_ids


def stage_bounds(model: nn.Module, num_stages: int, hint: str = "") -> list[tuple[int, int]]:
    """The ``[start, stop)`` range of split units (layers or blocks) of each stage."""
    names, weights = split_units(model)
    if num_stages > len(names):
        unit = "transformer layers" if _is_gpt(model) else "residual blocks"
        raise BadInput(
            f"{num_stages} pipeline stages{hint} but the model has only {len(names)} {unit}; "
            f"every stage needs at least one"
        )
    return balance(weights, num_stages)


def stage_parameter_counts(model: nn.Module, num_stages: int) -> list[int]:
    """Parameters held by each stage of a ``num_stages`` split (for tests and docs)."""
    _, weights = split_units(model)
    return [sum(weights[start:stop]) for start, stop in stage_bounds(model, num_stages)]


def _stages_hint(pp_size: int, per_rank: int, schedule: str) -> str:
    if per_rank == 1:
        return f" (--pp {pp_size})"
    return f" (--pp {pp_size} x {per_rank} per rank for {schedule})"


def split_units(model: nn.Module) -> tuple[list[str], list[int]]:
    """Names of the units a split may cut between, and the parameters each brings to its stage
    (the first unit carries the embeddings/stem, the last the norm/output/head)."""
    if _is_gpt(model):
        names = list(model.layers.keys())
        weights = [_numel(model.layers[name]) for name in names]
        first, last = [model.tok_embeddings], [model.norm, model.output]
    elif isinstance(model, ResNet):
        blocks = _resnet_block_indices(model)
        names = [str(i) for i in blocks]
        weights = [_numel(model.layers[i]) for i in blocks]
        first = list(model.layers[: blocks[0]])
        last = list(model.layers[blocks[-1] + 1 :])
    else:
        raise BadInput(
            f"pipeline parallelism splits the transformer (gpt-*, llama-*) and the ResNets, not {type(model).__name__}"
        )
    if not names:
        raise BadInput("the model has no layers to split between pipeline stages")
    weights[0] += sum(_numel(m) for m in first if m is not None)
    weights[-1] += sum(_numel(m) for m in last if m is not None)
    return names, weights


def balance(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ``[start, stop)`` ranges of ``weights`` minimizing the heaviest range;
    among those, the smaller sum of squares (a deterministic, evener split)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} units into {parts} non-empty parts")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    worst = (math.inf, math.inf)
    # best[k][j]: (heaviest part, sum of squares) splitting the first j units into k parts.
    best = [[worst] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0, 0)
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                heaviest, squares = best[k - 1][i]
                part = prefix[j] - prefix[i]
                candidate = (max(heaviest, part), squares + part * part)
                if candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    bounds, stop = [], n
    for k in range(parts, 0, -1):
        start = cut[k][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


def _make_chunk(model: nn.Module, bounds: list[tuple[int, int]], stage: int) -> nn.Module:
    start, stop = bounds[stage]
    first, last = stage == 0, stage == len(bounds) - 1
    if _is_gpt(model):
        return _gpt_chunk(model, list(model.layers.keys())[start:stop], first, last)
    return _resnet_chunk(model, _resnet_block_indices(model), start, stop, first, last)


def _gpt_chunk(model: nn.Module, names: list[str], first: bool, last: bool) -> nn.Module:
    chunk = _shell(model)
    # A ModuleDict keyed by the original layer names keeps the FQNs ("layers.5....").
    chunk.layers = nn.ModuleDict({name: model.layers[name] for name in names})
    if not first:
        chunk.tok_embeddings = None  # GPT.forward then takes hidden states
    if not last:
        chunk.norm = None
        chunk.output = None  # GPT.forward then returns hidden states
    return chunk


def _resnet_chunk(model: ResNet, blocks: list[int], start: int, stop: int, first: bool, last: bool) -> nn.Module:
    keep = blocks[start:stop]
    if first:
        keep = list(range(blocks[0])) + keep
    if last:
        keep = keep + list(range(blocks[-1] + 1, len(model.layers)))
    chunk = _shell(model)
    # Sequential from an OrderedDict keeps the original indices as names ("layers.7...."); deleting
    # from the original Sequential would renumber them and change the state-dict keys.
    chunk.layers = nn.Sequential(OrderedDict((str(i), model.layers[i]) for i in keep))
    return chunk


def _shell(model: nn.Module) -> nn.Module:
    """A new object of the model's class sharing its submodules, with its own tables of children,
    parameters, buffers and hooks: replacing a child of the shell, or wrapping it later (FSDP,
    which registers hooks on the chunk root), leaves the model and the other chunks untouched."""
    shell = copy.copy(model)
    for name, value in vars(model).items():
        if isinstance(value, (dict, set, list)):
            shell.__dict__[name] = copy.copy(value)
    return shell


def _is_gpt(model: nn.Module) -> bool:
    # Duck-typed on the interface of training.torch.transformer.GPT, so this module does not import it.
    return isinstance(getattr(model, "layers", None), nn.ModuleDict) and hasattr(model, "tok_embeddings")


def _resnet_block_indices(model: ResNet) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer, (Bottleneck, BasicBlock))]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------- running and timing


class _BusyClock:
    """Busy spans and the step's span on one rank: perf_counter on CPU, CUDA events on CUDA
    (host clocks would time kernel launches, not kernels)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.reset()

    def reset(self) -> None:
        self._depth = 0
        self.spans: list[tuple[Any, Any]] = []

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin: Any, end: Any) -> float:
        if not self.cuda:
            return end - begin
        return begin.elapsed_time(end) / 1000.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        # Re-entrant: only the outermost span counts, so nothing is counted twice.
        self._depth += 1
        begin = self.now() if self._depth == 1 else None
        try:
            yield
        finally:
            self._depth -= 1
            if begin is not None:
                self.spans.append((begin, self.now()))

    def busy_seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return sum(self.seconds(begin, end) for begin, end in self.spans)


class _TimedStage(PipelineStage):
    """A PipelineStage that adds its forward and backward compute to a :class:`_BusyClock`."""

    def __init__(self, *args: Any, clock: _BusyClock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock = clock
        self._buffers_before_inference: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.busy():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.busy():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.busy():
            return super().backward_weight_one_chunk(*args, **kwargs)

    # Before the first step, PipelineStage learns the shapes it sends by running the stage forward
    # and backward in training mode on a torch.empty input (the first stage: on its first
    # microbatch), which updates BatchNorm's running statistics with garbage (NaN in ResNet's
    # exports). The buffers are put back once that is over (torch's own cleanup hook runs last), so
    # the statistics come from real batches only, as in one process.
    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self._buffers_before_inference = [(buffer, buffer.clone()) for buffer in self.submod.buffers()]
        return super()._forward_metadata_inference(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        with torch.no_grad():
            for buffer, value in self._buffers_before_inference:
                buffer.copy_(value)
        self._buffers_before_inference = []


class Pipeline:
    """One rank's side of a pipeline schedule; see :func:`build_pipeline`."""

    def __init__(
        self, schedule: Any, stages: list[_TimedStage], clock: _BusyClock, group: Any, microbatches: int
    ) -> None:
        self._schedule = schedule
        self.stages = stages
        self._clock = clock
        self._group = group
        self.microbatches = microbatches
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)
        self.last_bubble_fraction: float | None = None

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward and backward of one batch through the pipeline; gradients land in the chunks.

        The rank with the first stage passes ``inputs``, the rank with the last ``targets`` and gets
        the mean loss over the microbatches; other ranks pass None and get None. Collective over
        the pipeline group (the schedule's send/receive, then the bubble's all-gather).
        """
        args = self._check_batch(inputs, targets)
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        self._clock.reset()
        begin = self._clock.now()
        # return_outputs=False: the logits of every microbatch are not kept for a merge nobody reads.
        self._schedule.step(*args, target=targets if self.has_last else None, losses=losses, return_outputs=False)
        end = self._clock.now()
        busy = self._clock.busy_seconds()
        self.last_bubble_fraction = self._pipeline_bubble(busy, self._clock.seconds(begin, end))
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def _check_batch(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if self.has_first and inputs is None:
            raise ValueError("the rank with the first stage must pass the inputs")
        if self.has_last and targets is None:
            raise ValueError("the rank with the last stage must pass the targets")
        for batch in (inputs, targets):
            if batch is not None and batch.shape[0] % self.microbatches:
                raise ValueError(
                    f"batch of {batch.shape[0]} does not split into {self.microbatches} equal microbatches"
                )
        # Contiguous: the first stage checks each microbatch's strides against the contiguous ones
        # it inferred (torch 2.11 refuses a mismatch), and tokens[:, :-1] is a strided view.
        return (inputs.contiguous(),) if self.has_first else ()

    def _pipeline_bubble(self, busy: float, wall: float) -> float:
        size = dist.get_world_size(self._group)
        local = torch.tensor([busy, wall], dtype=torch.float64, device=self.stages[0].device)
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=self._group)
        total_busy = sum(float(t[0]) for t in gathered)
        longest = max(float(t[1]) for t in gathered)
        if longest <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - total_busy / (size * longest)))


def contiguous_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A stage's activations travel to the next stage, and gloo and NCCL send only contiguous
    tensors: ResNet's are channels-last (strided), so they are made contiguous first."""
    return output.contiguous() if isinstance(output, torch.Tensor) else output


def build_pipeline(
    chunks: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    pp_group: Any,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: LossFn,
) -> Pipeline:
    """A :class:`Pipeline` over this rank's ``chunks`` (from :func:`split_for_pipeline`, after any
    TP/FSDP wrapping). ``loss_fn(output, target)`` must return the mean over its microbatch."""
    check_microbatches(microbatches, dist.get_world_size(pp_group), schedule)
    if len(chunks) != len(stage_ids) or not chunks:
        raise ValueError(f"{len(chunks)} chunks for stage ids {stage_ids}")
    clock = _BusyClock(device)
    for chunk, stage_id in zip(chunks, stage_ids, strict=True):
        if stage_id < num_stages - 1:
            chunk.register_forward_hook(contiguous_output)

    def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with clock.busy():  # the loss is the last stage's compute too (its backward is in backward_one_chunk)
            return loss_fn(output, target)

    stages = [
        _TimedStage(chunk, stage_id, num_stages, device, group=pp_group, clock=clock)
        for chunk, stage_id in zip(chunks, stage_ids, strict=True)
    ]
    if schedule == "interleaved-1f1b":
        runner: Any = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=timed_loss, scale_grads=True)
    else:
        if len(stages) != 1:
            raise ValueError(f"{schedule} runs one stage per rank, got {len(stages)}")
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = kind(stages[0], microbatches, loss_fn=timed_loss, scale_grads=True)
    return Pipeline(runner, stages, clock, pp_group, microbatches)
