"""What a rank holds and how fast it computes: local parameters and bytes, peak memory, MFU.

Peak memory is what the device or process actually reached: on GPU the CUDA caching allocator's
maximum allocated bytes (tensors, not the cache it reserved); on CPU the process's peak resident
set (``ru_maxrss``), which includes the Python runtime and torch's libraries (a few hundred MB).

MFU (model FLOPs utilization, Chowdhery et al. 2022) is the model's training FLOPs per second
(:func:`training.transformer.flops_per_token` x tokens/s) over the GPUs' dense bf16 peak. The
peaks are NVIDIA's datasheet numbers without sparsity; a GPU that is not in the table gets no MFU
rather than a guessed one.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
