"""The plain-PyTorch loops that ``python -m bench.gpu`` sets our jobs beside, on the same GPU.

``resnet``: torchvision's recipe (``references/classification/train.py`` with ``--channels-last``
and bf16 autocast): ``torchvision.models.resnet50``, channels-last weights and input, SGD with
momentum, a fixed synthetic batch already on the GPU, cuDNN autotuning, ``torch.compile`` of the
model when asked. Under the same wrapper as our job: at world size 1 neither has one.

``gpt``: a bare loop of the same ``training.torch.transformer`` model as the model-parallel job: fused
AdamW (same settings), bf16 autocast, ``torch.compile`` of the whole model, and the job's own loss
function (fp32 cross-entropy), compiled as the job compiles it, a fixed batch of random tokens on
the GPU.

Both time what the jobs' ``StepTimer`` times: the first ``--timing-warmup-steps`` are left out,
then wall time to the end of the last step. Between those two synchronisations the host reads the
loss (``.item()``) after every ``--log-every``-th step, where the jobs log it, and nowhere else. Run:
``python -m bench.gpu.baselines {resnet,gpt} --help``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.config.args import positive_int
from training.config.models import GPT_CONFIGS, flops_per_token
from training.model_parallel import loss_fn
from training.torch.parallel.memory import mfu, peak_memory_bytes
from training.torch.transformer import build_gpt


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.baselines", description=__doc__.splitlines()[0])
    loops = parser.add_subparsers(dest="loop", required=True)
    resnet = loops.add_parser("resnet", help="torchvision's ResNet recipe")
    resnet.add_argument("--model", default="resnet50", help="a torchvision.models name (default resnet50)")
    resnet.add_argument("--image-size", type=int, default=224)
    resnet.add_argument("--batch-size", type=int, default=256)
    resnet.add_argument("--num-classes", type=int, default=1000)
    gpt = loops.add_parser("gpt", help="a bare loop of training.torch.transformer")
    gpt.add_argument("--model", choices=sorted(GPT_CONFIGS), default="gpt-125m")
    gpt.add_argument("--seq-len", type=int, default=1024)
    gpt.add_argument("--batch-size", type=int, default=16)
    for loop in (resnet, gpt):
        loop.add_argument("--steps", type=int, default=60, help="steps including the warmup steps")
        loop.add_argument("--timing-warmup-steps", type=int, default=10)
        loop.add_argument(
            "--log-every",
            type=positive_int,
            default=10,
            help="read the loss on the host after every Nth step, where the jobs log it (default: theirs, 10)",
        )
        loop.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
        loop.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
        loop.add_argument("--metrics-json", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.steps <= args.timing_warmup_steps:
        parser.error("--steps must exceed --timing-warmup-steps")
    return args


def torchvision_resnet(name: str, num_classes: int) -> tuple[nn.Module, str, bool]:
    """torchvision's model, its name, False; or ours of the same name, and True: ours takes uint8 NHWC
    images and normalizes them itself. Ours where torchvision does not import (the CPU build of
    torch beside torchvision's wheel, see bench/cpu/tv_baseline.py) or has no such model (``bench.gpu
    --smoke``'s resnet_tiny)."""
    try:
        import torchvision

        if name in torchvision.models.list_models():
            return torchvision.models.get_model(name, num_classes=num_classes), f"torchvision.models.{name}", False
        reason = "torchvision has no such model"
    except (ImportError, RuntimeError):
        reason = "torchvision does not import here"
    from training.torch.models import build_model

    return build_model(name, num_classes), f"training.torch.models.{name} ({reason})", True


def timed_loop(
    step: Callable[[], torch.Tensor], args: argparse.Namespace, device: torch.device
) -> tuple[float, torch.Tensor]:
    """Seconds of steps ``--timing-warmup-steps + 1`` to ``--steps``, and the last loss; the loss is
    read on the host after every ``--log-every``-th step (a host sync, as the jobs' log steps)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    start = time.perf_counter()
    loss = torch.zeros(())
    for index in range(args.steps):
        if index == args.timing_warmup_steps:
            sync()
            start = time.perf_counter()
        loss = step()
        if (index + 1) % args.log_every == 0:
            loss.item()
    sync()
    return time.perf_counter() - start, loss


def resnet(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch.backends.cudnn.benchmark = True
    model, source, ours = torchvision_resnet(args.model, args.num_classes)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    forward = torch.compile(model) if args.compile else model
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    images = torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last)
    if ours:
        images = torch.randint(0, 256, (args.batch_size, args.image_size, args.image_size, 3), device=device)
        images = images.to(torch.uint8)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    model.train()

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    elapsed, loss = timed_loop(step, args, device)
    rate = args.batch_size * (args.steps - args.timing_warmup_steps) / elapsed
    return {"images_per_sec": rate, "model": source, "input": "uint8" if ours else "float", "loss": float(loss)}


def gpt(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = GPT_CONFIGS[args.model]
    model = build_gpt(cfg, 0, device=device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused or None
    )
    forward = torch.compile(model) if args.compile else model
    # as training.model_parallel compiles its loss: the fp32 logits are never materialized
    loss_of = torch.compile(loss_fn, fullgraph=True, dynamic=False) if args.compile else loss_fn
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device, generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    elapsed, loss = timed_loop(step, args, device)
    rate = args.batch_size * args.seq_len * (args.steps - args.timing_warmup_steps) / elapsed
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "tokens_per_sec": rate,
        "mfu": mfu(rate, flops_per_token(cfg, args.seq_len), name, 1),
        "peak_memory_bytes": peak_memory_bytes(device),
        "loss": float(loss),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # torch 2.11 refuses a device without an index
    result = resnet(args, device) if args.loop == "resnet" else gpt(args, device)
    if device.type == "cuda":
        result.setdefault("peak_memory_bytes", peak_memory_bytes(device))
    args.metrics_json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
