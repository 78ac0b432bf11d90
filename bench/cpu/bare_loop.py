"""The overhead baseline: a bare single-process PyTorch training loop.

Same model (``training.torch.models``), optimizer settings, batch and image size as the job,
on one fixed synthetic batch like the job's synthetic mode, on the GPU when there is one and
with bf16 autocast under ``--precision amp`` as the job does; nothing else: no Horovod, no
schedule, no checkpoint or metrics bookkeeping. Its rate is timed exactly as the job's
``StepTimer`` does: the first ``--timing-warmup-steps`` are excluded, then wall time to the
end of the last step. Run: ``python -m bench.cpu.bare_loop --help``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from training.torch.models import MODELS, build_model


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu.bare_loop", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20, help="steps including the warmup steps")
    parser.add_argument("--timing-warmup-steps", type=int, default=5)
    parser.add_argument("--precision", choices=("fp32", "amp"), default="fp32", help="amp: bfloat16 autocast")
    parser.add_argument("--metrics-json", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.steps <= args.timing_warmup_steps:
        parser.error("--steps must exceed --timing-warmup-steps")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None  # the clock must see finished work
    torch.manual_seed(0)
    model = build_model(args.model, args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9, weight_decay=1e-4)
    shape = (args.batch_size, args.image_size, args.image_size, 3)
    images = torch.randint(0, 256, shape, dtype=torch.uint8).to(device)
    labels = torch.randint(0, args.num_classes, (args.batch_size,)).to(device)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.timing_warmup_steps:
            sync()
            start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "amp"):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    sync()
    elapsed = time.perf_counter() - start
    measured = args.steps - args.timing_warmup_steps
    rate = args.batch_size * measured / elapsed
    args.metrics_json.write_text(json.dumps({"images_per_sec": rate, "loss": loss.item()}))


if __name__ == "__main__":
    main()
