"""The measured runs of ``bench.cpu.local_sgd``, under torchrun: an MLP trained by DDP with each of the
job's ``--sync`` modes in turn (training.torch.sync, the code ``training.pytorch`` runs), timed step by
step. One launch for all the modes: starting 4 processes costs more than a run here.

The task: inputs drawn from a normal distribution, labels from a fixed random linear teacher, a
fresh batch per rank and step (independent, identically distributed shards, as data parallelism
gives). The model is wide enough that its gradients are megabytes (0.8M parameters, 3.3 MB in
fp32) while a step costs a few tens of milliseconds on a CPU core: at 100 Mbit/s the allreduce
dominates a synchronous step.

The global model is evaluated every ``--every`` steps in every mode, at the points where the
periodic modes have just averaged over every rank (so that the replicas are one model): each
rank's loss on a fixed held-out batch, averaged over the ranks. Evaluation is left out of the
training time; the time at an evaluation is the slowest rank's training time so far. The
every-step run comes first; its final loss is the target at which each periodic run stops (or at
twice its steps). Rank 0 writes ``{"runs": {mode: [[steps done, seconds, loss], ...]}, ...}`` to
``--metrics-json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bench.harness.proc import exit_worker
from training.config.sync import AVERAGE, EVERY_STEP, HIERARCHICAL, LOCAL_SGD, NESTEROV, SyncSettings
from training.torch.sync import PeriodicSync, check_layout

FEATURES, HIDDEN, CLASSES = 256, 768, 32
VARIANTS = tuple(f"{mode}{outer}" for mode in (LOCAL_SGD, HIERARCHICAL) for outer in ("", f"+{NESTEROV}"))
EVAL_SAMPLES = 1024
TEACHER_SEED = 1234


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m bench.cpu.local_sgd_worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--periodic",
        nargs="*",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="the periodic runs after every-step's: MODE (plain average) or MODE+nesterov (DiLoCo's outer step)",
    )
    parser.add_argument("--every", type=int, default=8, help="H, and the steps between two evaluations")
    parser.add_argument("--steps", type=int, required=True, help="every-step's steps; the periodic runs stop at 2x")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-json", type=Path, required=True)
    return parser.parse_args(argv)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


class Teacher:
    """Labels from a fixed random linear map: the same on every rank, whatever its data seed."""

    def __init__(self) -> None:
        self.weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(TEACHER_SEED))

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(size, FEATURES, generator=generator)
        return inputs, (inputs @ self.weights).argmax(1)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    dist.init_process_group("gloo")
    world, local_size = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    local_sizes: list[int] = [0] * world
    dist.all_gather_object(local_sizes, local_size)
    check_layout(local_sizes)
    synchronous = train(args, SyncSettings(), args.steps, None)
    runs = {EVERY_STEP: synchronous}
    for variant in args.periodic:
        mode, _, outer = variant.partition("+")
        settings = SyncSettings(mode, args.every, outer=outer or AVERAGE)
        runs[variant] = train(args, settings, 2 * args.steps, target=synchronous[-1][2])
    if dist.get_rank() == 0:
        parameters = sum(p.numel() for p in build_model().parameters())
        args.metrics_json.write_text(json.dumps({"world_size": world, "parameters": parameters, "runs": runs}))
    dist.barrier()
    exit_worker()


def train(args: argparse.Namespace, settings: SyncSettings, steps: int, target: float | None) -> list[list[float]]:
    """One run from the same initial weights and data: its evaluations ``[steps done, seconds, loss]``."""
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = build_model()
    ddp = DistributedDataParallel(model)
    periodic = PeriodicSync(settings, ddp, int(os.environ["LOCAL_WORLD_SIZE"]), 0) if settings.periodic else None
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    teacher = Teacher()
    data = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    held_out = teacher.batch(EVAL_SAMPLES, torch.Generator().manual_seed(10_000 + rank))
    evals: list[list[float]] = [[0, 0.0, evaluate(model, held_out)]]
    trained_s = 0.0
    dist.barrier()
    for step in range(steps):
        started = time.perf_counter()
        inputs, labels = teacher.batch(args.batch_size, data)
        optimizer.zero_grad()
        F.cross_entropy(ddp(inputs), labels).backward()
        optimizer.step()
        if periodic is not None:
            periodic.after_step(step)
        trained_s += time.perf_counter() - started
        done = step + 1
        if done % args.every == 0:
            slowest = torch.tensor([trained_s])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            evals.append([done, float(slowest), evaluate(model, held_out)])
            if target is not None and evals[-1][2] <= target:
                break
    return evals


@torch.no_grad()
def evaluate(model: nn.Module, held_out: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The global model's loss: every rank's on its held-out batch, averaged over the ranks."""
    inputs, labels = held_out
    loss = F.cross_entropy(model(inputs), labels).reshape(1)
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


if __name__ == "__main__":
    main()
