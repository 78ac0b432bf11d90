"""Tensor parallel, activation checkpointing, torch.compile and FSDP2 for one model (or one pipeline chunk).

Applied in torchtitan's order: tensor parallel first (it turns the block's weights into DTensors
on the ``tp`` mesh), activation checkpointing next (each block's forward runs under
``torch.utils.checkpoint``), then ``torch.compile`` of each block, FSDP last (it shards whatever
it finds, DTensors included, over the data-parallel mesh, and its hooks stay outside the compiled
blocks).

* **Tensor parallel** (Megatron-LM's split, through DTensor): ``wq``/``wk``/``wv`` and the MLP's
  ``w1``/``w3`` are column-sharded, so each rank runs whole heads and a slice of the MLP on the
  full (replicated) input; ``wo`` and ``w2`` are row-sharded and their partial sums are
  all-reduced. Two all-reduces per block forward, two in backward. Embeddings, norms and the
  output layer stay whole on every TP rank: they compute the same values everywhere, and the
  input gradients of the column-sharded layers are all-reduced, so their gradients agree.
  Sequence parallelism (optional in the issue) is not implemented: it would also shard the norms'
  activations along the sequence, turning each all-reduce into a reduce-scatter and an all-gather.
* **FSDP2**: ``fully_shard`` on every block, on the embeddings, on the final norm and output layer
  together, then on the root. Data-parallel ranks other than the FSDP group replicate: HSDP
  on the 2-D ``(dp_replicate, dp_shard)`` mesh, gradients reduce-scattered within the shard group
  and all-reduced across replicas. Pure replication (``--dp-shard 1``) is the same code with a
  shard group of one, which is DDP's arithmetic (whole parameters, all-reduced gradients) and
  works on gloo and NCCL alike. One process (world size 1) has nothing to shard or reduce: it
  trains the plain model, under ``torch.autocast`` for bf16 (no FSDP hooks, copies or casts per
  block). FSDP also wraps a model that only uses TP (a shard group of one),
  so that every parameter is a DTensor: AdamW's foreach implementation (the default on GPU)
  refuses a mix of DTensors and plain tensors.
  With a pipeline, parameters stay unsharded from forward to backward (``reshard_after_forward=False``):
  otherwise every microbatch would all-gather them again.
* **Mixed precision** (``--precision bf16``, GPU only): parameters all-gathered and computed in
  bf16, gradients reduced and the optimizer step taken in fp32 (``MixedPrecisionPolicy``); in one
  process, bf16 autocast over fp32 parameters (the plain PyTorch recipe).
* **Activation checkpointing**, per block, without changing parameter names: the block's
  ``forward`` is replaced by one that runs it under non-reentrant ``torch.utils.checkpoint``
  (torchtitan wraps the block in a module instead, which renames every parameter; the composable
  ``checkpoint`` keeps names but its hooks cannot be compiled). ``full`` keeps only each block's
  input and recomputes the block in backward; ``selective`` keeps the outputs of matmuls,
  convolutions, attention and collectives and recomputes the cheap element-wise work (norms,
  activations, rotary embeddings). ``auto`` is resolved before this module is called
  (:func:`training.torch.parallel.memory.choose_activation_checkpointing`).
* **torch.compile**, per block (``nn.Module.compile``: in place, parameter names unchanged), as
  torchtitan does: the blocks are identical, so one compilation serves them all, and FSDP's
  all-gathers and reduce-scatters stay eager between blocks, where they overlap compute.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from training.config.activation_checkpointing import AC_MODES
from training.config.layout import Layout
from training.torch.models import BasicBlock, Bottleneck
from training.torch.transformer import Block

UNIT_TYPES = (Block, Bottleneck, BasicBlock)  # FSDP and activation-checkpointing units

_aten = torch.ops.aten
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    # Recomputing a collective would mean communicating again (and out of step with other ranks).
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units (transformer layers, residual blocks) that this rank holds."""
    return [module for module in model.modules() if isinstance(module, UNIT_TYPES)]


def tensor_parallel_plan(block: Block) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    for block in blocks(model):
        assert isinstance(block, Block), "tensor parallelism is for transformer blocks (layout.check_model)"
        parallelize_module(block, tp_mesh, tensor_parallel_plan(block))


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any] | None, *args: Any) -> Any:
    if context_fn is None:  # full: dynamo traces checkpoint without a context_fn, not with the no-op one
        return checkpoint(forward, *args, use_reentrant=False)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {AC_MODES}")
    if mode == "none":
        return
    context = partial(create_selective_checkpoint_contexts, _keep_expensive) if mode == "selective" else None
    for block in blocks(model):
        # An instance attribute: nn.Module.__call__ (and its compiled version) calls it in place of
        # the class's forward, and the module tree, hence every parameter name, stays as it was.
        block.forward = partial(_checkpointed, block.forward, context)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block in place (whole graphs, static shapes: a break or a recompile
    per step would be a bug, not a fallback)."""
    units = blocks(model)
    # ResNet's blocks come in up to 8 shapes (stride, width); each is a specialization of one
    # code object, and dynamo's default limit of 8 recompilations must not leave the last ones eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, len(units))
    for unit in units:
        unit.compile(fullgraph=True, dynamic=False)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def data_parallel_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """FSDP's mesh: 1-D over the shard group, or 2-D (replicate, shard) for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


def uses_fsdp(layout: Layout, precision: str) -> bool:
    """A single process trains the plain model: nothing to shard or reduce, so FSDP would only add
    its per-block hooks, copies and casts (bf16 there is autocast: :func:`autocasts`). The fp32 run
    is the reference the equivalence tests use. A bf16 pipeline takes FSDP's mixed precision."""
    return layout.dp > 1 or layout.tp > 1 or (precision == "bf16" and layout.pp > 1)


def autocasts(layout: Layout, precision: str) -> bool:
    """Whether the step runs under bf16 ``torch.autocast``: bf16 without FSDP's mixed precision."""
    return precision == "bf16" and not uses_fsdp(layout, precision)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, policy: MixedPrecisionPolicy, pipelined: bool) -> None:
    """``fully_shard`` per block, on the transformer's embeddings and on its norm + output, then on
    the root. The embeddings and the output matrix are units of their own because they are the
    largest (half of gpt-125m): gathered with the root, they would be whole at once on every rank."""
    reshard = False if pipelined else None  # None: after forward for blocks, never for the root
    for block in blocks(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is not None:
        fully_shard(embeddings, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    head = [module for module in (getattr(model, "norm", None), getattr(model, "output", None)) if module is not None]
    if getattr(model, "output", None) is not None:
        # Backward starts with these: keep them gathered from forward (no second all-gather).
        fully_shard(head, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: DeviceMesh,
    precision: str,
    activation_checkpointing: str,
    compile_blocks: bool = False,
) -> None:
    """TP, activation checkpointing, compile, then FSDP on ``model`` (a whole model or a pipeline chunk), in place."""
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile_blocks:
        apply_compile(model)
    if uses_fsdp(layout, precision):
        apply_fsdp(model, data_parallel_mesh(mesh, layout), mixed_precision(precision), pipelined=layout.pp > 1)
