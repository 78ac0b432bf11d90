"""What a rank holds and how fast it computes: local parameters and bytes, peak memory, MFU, and
the estimate behind ``--activation-checkpointing auto``.

Peak memory is what the device or process actually reached: on GPU the CUDA caching allocator's
maximum allocated bytes (tensors, not the cache it reserved); on CPU the process's peak resident
set (``ru_maxrss``), which includes the Python runtime and torch's libraries (a few hundred MB).

MFU (model FLOPs utilization, Chowdhery et al. 2022) is the model's training FLOPs per second
(:func:`training.config.models.flops_per_token` x tokens/s) over the GPUs' dense bf16 peak. The
peaks are NVIDIA's datasheet numbers without sparsity; a GPU that is not in the table gets no MFU
rather than a guessed one.

The estimate (:func:`estimate_bytes`) is a transformer rank's peak before it runs: AdamW's fp32
state (parameter, gradient, two moments: 16 bytes per parameter, divided by the FSDP, TP and
pipeline degrees), the activations that backward keeps, and the logits. Per token and layer a
block keeps, in the compute dtype: its input, the two norms' inputs, q/k/v, the rotary copies of
q and k, the attention output and its projection's input, and the MLP's input and hidden
activations (2 of ``ffn_dim`` for GELU, 4 for SwiGLU); ``selective`` keeps the matmul and
attention outputs only, ``full`` the block's input only (plus one block's worth while it is
recomputed). The logits cost the compute dtype plus an fp32 copy and its gradient per vocabulary
entry. Against the H100 run of docs/performance.md (bf16, one GPU) it gives 39.2 GiB for gpt-1.3b
at seq 2048, batch 4 (measured peaks: 32.8 GiB in the job, 37 GiB in a plain compiled loop) and
15.4 GiB for gpt-125m at seq 1024, batch 16 (measured: 15.7 GiB). ``auto`` picks the first of none, selective,
full whose estimate fits in 90% of the device's memory (the rest is the CUDA context, cuBLAS and
NCCL workspaces and the allocator's fragmentation); on a CPU, and for ResNets (whose activations
this does not model), ``auto`` is ``none``.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.config.activation_checkpointing import AC_MODES, AUTO
from training.config.layout import Layout
from training.config.models import GPTConfig, parameter_count

log = logging.getLogger(__name__)

DEVICE_SHARE = 0.9  # of the device's memory the estimate may use (see the module docstring)

# (substring of torch.cuda.get_device_name, dense bf16 FLOP/s). The first match wins, so the
# variants come before the plain name: "NVIDIA H100 PCIe" must not read as an H100 SXM.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312e12),  # SXM and PCIe alike
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of one GPU called ``device_name`` (as CUDA names it), None if unknown."""
    name = device_name.upper()
    return next((flops for key, flops in PEAK_BF16_FLOPS if key.upper() in name), None)


def local_parameters(modules: Iterable[nn.Module]) -> tuple[int, int]:
    """(elements, bytes) of the parameters this rank stores: its shard of each DTensor, every
    element of a plain tensor. Shared parameters count once."""
    seen: set[int] = set()
    count = size = 0
    for module in modules:
        for param in module.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            local = param.to_local() if isinstance(param, DTensor) else param
            count += local.numel()
            size += local.numel() * local.element_size()
    return count, size


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mfu(tokens_per_sec: float | None, flops_per_token: float, device_name: str, gpus: int) -> float | None:
    """Model FLOPs utilization of ``gpus`` GPUs called ``device_name``; None off GPU or when unknown."""
    peak = peak_flops(device_name)
    if tokens_per_sec is None or peak is None:
        return None
    return tokens_per_sec * flops_per_token / (peak * gpus)


def activation_elements(cfg: GPTConfig, mode: str) -> int:
    """Elements one block keeps per token for backward under activation checkpointing ``mode``."""
    hidden = (4 if cfg.swiglu else 2) * cfg.ffn_dim  # w1 (and w3) outputs, the activation (and product)
    kv = 2 * cfg.kv_heads * cfg.head_dim
    if mode == "none":
        # input, 2 norm inputs, q, k, v, rotated q and k, attention output, wo input, MLP input
        return 7 * cfg.dim + 2 * kv + hidden
    if mode == "selective":
        # input, q, k, v, attention output, wo output, w1 (and w3) outputs, w2 output
        return 4 * cfg.dim + kv + hidden // 2
    return cfg.dim  # full: the block's input


def estimate_bytes(cfg: GPTConfig, layout: Layout, batch_size: int, seq_len: int, precision: str, mode: str) -> int:
    """A transformer rank's peak memory under ``mode`` (see the module docstring): an upper estimate."""
    act = 2 if precision == "bf16" else 4
    tokens = batch_size * seq_len  # a pipeline's first stage holds up to the whole batch in flight
    layers = -(-cfg.n_layers // layout.pp)
    state = 16 * parameter_count(cfg) // (layout.dp_shard * layout.tp * layout.pp)
    kept = layers * tokens * activation_elements(cfg, mode) * act // layout.tp
    if mode == "full":  # the block being recomputed holds its activations again
        kept += tokens * activation_elements(cfg, "none") * act // layout.tp
    logits = tokens * cfg.vocab_size * (act + 8)
    return state + kept + logits


def device_memory_bytes(device: torch.device) -> int | None:
    """The GPU's memory, None on a CPU (whose limit is not one activation checkpointing is for)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def choose_activation_checkpointing(
    requested: str,
    cfg: GPTConfig | None,
    layout: Layout,
    batch_size: int,
    seq_len: int | None,
    precision: str,
    device_bytes: int | None,
) -> str:
    """``requested``, or for ``auto`` the least recomputation whose estimate fits ``device_bytes``."""
    if requested != AUTO:
        return requested
    if cfg is None or seq_len is None or device_bytes is None:
        return "none"
    budget = DEVICE_SHARE * device_bytes
    for mode in AC_MODES:
        if estimate_bytes(cfg, layout, batch_size, seq_len, precision, mode) <= budget:
            return mode
    need = estimate_bytes(cfg, layout, batch_size, seq_len, precision, "full") / 2**30
    log.warning(
        "%s needs about %.1f GiB per rank even with full activation checkpointing (%.1f GiB usable): "
        "shard wider (more ranks, --dp-shard, --tp, --pp) or lower --batch-size or --seq-len",
        cfg.name, need, budget / 2**30,
    )  # fmt: skip
    return "full"
