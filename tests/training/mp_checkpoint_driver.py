"""A test-only driver for tests/training/test_mp_checkpoint.py, run under torchrun (gloo).

It trains a tiny residual MLP (:class:`TinyNet`, laid out like the transformer: ``layers`` is a
ModuleDict, the input and output layers may be None on pipeline stages) with AdamW, sharded with
FSDP2 per block over every rank, on a global batch that depends only on (seed, step), and saves
and resumes through :class:`training.checkpoint.sharded.ShardedCheckpoints` as the job does.
Small and quick to start, so that the kill test can start twenty runs; the resume tests drive the
real job.

``--mode train``: resume from the newest checkpoint, train to ``--steps``, save every
``--checkpoint-every`` steps with a digest of the state in ``extra``; rank 0 appends one JSON line
per step (step, loss, world size) to ``--losses``. ``--stall-at K`` makes every rank sleep after
step K's save, so that a test can SIGKILL a run known to be mid-way.

``--mode verify``: load ``--load`` (default: the newest) into ``--layout`` (fsdp, tp: the MLPs
column/row sharded, pp: each rank holds a contiguous slice of the layers, plain: one process),
then rank 0 writes every rank's full (gathered) model and optimizer state to ``--dump``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from training.checkpoint.sharded import ShardedCheckpoints

MODEL = "tinynet"
FEATURES, DIM, CLASSES, LAYERS = 8, 24, 5, 4  # 24 * 2 = 48 rows: fc1 shards unevenly over 5 ranks, evenly over 1, 2, 4
LR, WEIGHT_DECAY = 1e-2, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp: nn.Linear | None = nn.Linear(FEATURES, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.head: nn.Linear | None = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def build(seed: int) -> TinyNet:
    """The same weights in every process and layout: built whole from the seed, then sharded."""
    torch.manual_seed(seed)
    return TinyNet()


def global_batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of (seed, step) only, so every layout trains on the same data."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))
    return x, (x @ teacher).argmax(dim=1)


def layout(model: TinyNet, name: str, rank: int, world: int) -> TinyNet:
    if name == "plain":
        assert world == 1, "the plain layout is one process"
    elif name == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {f"layers.{i}.fc1": ColwiseParallel() for i in range(LAYERS)}
        plan.update({f"layers.{i}.fc2": RowwiseParallel() for i in range(LAYERS)})
        parallelize_module(model, mesh, plan)
    elif name == "pp":  # this rank's stage; the others' layers are deleted, names kept
        per = LAYERS // world
        for i in range(LAYERS):
            if not rank * per <= i < (rank + 1) * per:
                del model.layers[str(i)]
        model.inp = model.inp if rank == 0 else None
        model.head = model.head if rank == world - 1 else None
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Sums of the parameters and of Adam's second moments over every rank's shards (fsdp, plain):
    a fingerprint of the state at this step, to check what a checkpoint loads back."""
    sums = torch.zeros(2, dtype=torch.float64)
    for p in model.parameters():
        sums[0] += local(p.detach()).double().sum()
        sums[1] += local(optimizer.state[p]["exp_avg_sq"]).double().sum()
    if dist.is_initialized():
        dist.all_reduce(sums)
    return {"param_sum": sums[0].item(), "exp_avg_sq_sum": sums[1].item()}


def train_step(model: TinyNet, optimizer: torch.optim.Optimizer, args: argparse.Namespace, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(args.seed, step, args.global_batch)
    rows = slice(rank * args.global_batch // world, (rank + 1) * args.global_batch // world)
    loss = F.cross_entropy(model(x[rows]), y[rows])  # mean over the local batch; FSDP averages gradients
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def train(args: argparse.Namespace, model: TinyNet, optimizer: torch.optim.Optimizer) -> None:
    ckpts = ShardedCheckpoints(args.checkpoint_dir, keep=args.keep)
    start = 0
    latest = ckpts.agreed_latest()
    if latest is not None:
        start = ckpts.load(latest, [model], [optimizer], expect={"model": MODEL})["step"]
        if dist.get_rank() == 0:
            print(f"resumed from step {start} ({latest.name})", flush=True)
    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, optimizer, args, step)
        if dist.get_rank() == 0 and args.losses is not None:
            with open(args.losses, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "world_size": dist.get_world_size()}) + "\n")
        if step % args.checkpoint_every == 0 or step == args.steps:
            extra = {"model": MODEL, "step": step, **digest(model, optimizer)}
            ckpts.save(step, [model], [optimizer], extra)
        if step == args.stall_at:
            if dist.get_rank() == 0:
                print(f"stalled at step {step}", flush=True)
            time.sleep(3600)  # until the test kills this run


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {f"model.{k}": v for k, v in model_sd.items()}
    state.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def verify(args: argparse.Namespace, model: TinyNet, optimizer: torch.optim.Optimizer) -> None:
    ckpts = ShardedCheckpoints(args.checkpoint_dir, keep=args.keep)
    path = args.load or ckpts.agreed_latest()
    extra = ckpts.load(path, [model], [optimizer], expect={"model": MODEL})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, full_state(model, optimizer))
    if dist.get_rank() == 0:
        merged: dict[str, Any] = {}
        for rank_state in gathered:
            merged.update(rank_state)
        torch.save({"extra": extra, "state": merged, "keys_per_rank": [sorted(s) for s in gathered]}, args.dump)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("train", "verify"), default="train")
    parser.add_argument("--layout", choices=("fsdp", "tp", "pp", "plain"), default="fsdp")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--losses", type=Path)
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--dump", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = layout(build(args.seed), args.layout, dist.get_rank(), dist.get_world_size())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        (verify if args.mode == "verify" else train)(args, model, optimizer)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (training.run.job explains the gloo race it avoids)


if __name__ == "__main__":
    main()
