"""One measured run of the communication-efficiency figure: the bare loop's ResNet steps on every
rank of ``horovodrun`` or ``torchrun``, with the gradient allreduce (Horovod's DistributedOptimizer,
DDP) or without it (the same processes and steps, each rank on its own).

Timing is the bare loop's: the first ``--timing-warmup-steps`` are left out, then wall time to the
end of the last step, and the CPU time of the process (every thread: Horovod's background thread
and gloo's are the allreduce's cost). Rank 0 writes the global images/s over the slowest rank's
wall time, and the images per CPU-second of all ranks together.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from bench.harness.proc import exit_worker
from training.torch.models import MODELS, build_model


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu.comm_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=("horovod", "ddp"), required=True)
    parser.add_argument("--allreduce", choices=("on", "off"), required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10, help="steps including the warmup steps")
    parser.add_argument("--timing-warmup-steps", type=int, default=2)
    parser.add_argument("--metrics-json", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.steps <= args.timing_warmup_steps:
        parser.error("--steps must exceed --timing-warmup-steps")
    return args


def horovod_setup(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, allreduce: bool
) -> tuple[torch.optim.Optimizer, Callable[[Any], list[Any]], int]:
    import horovod.torch as hvd

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if allreduce:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return optimizer, hvd.allgather_object, hvd.rank()


def ddp_setup(model: torch.nn.Module) -> tuple[DistributedDataParallel, Callable[[Any], list[Any]], int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def allgather(obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    # DDP broadcasts rank 0's weights, as Horovod's setup does.
    return DistributedDataParallel(model), allgather, dist.get_rank()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.manual_seed(0)
    model = build_model(args.model, args.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9, weight_decay=1e-4)
    allreduce = args.allreduce == "on"
    trained: torch.nn.Module = model
    skip_allreduce: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if args.launcher == "horovod":
        optimizer, allgather, rank = horovod_setup(model, optimizer, allreduce)
    else:
        trained, allgather, rank = ddp_setup(model)
        if not allreduce:
            skip_allreduce = trained.no_sync  # DDP's documented way to skip the gradient allreduce
    images = torch.randint(0, 256, (args.batch_size, args.image_size, args.image_size, 3), dtype=torch.uint8)
    labels = torch.randint(0, args.num_classes, (args.batch_size,))
    wall = cpu = 0.0
    for step in range(args.steps):
        if step == args.timing_warmup_steps:
            wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        with skip_allreduce():
            F.cross_entropy(trained(images), labels).backward()
        optimizer.step()
    mine = (time.perf_counter() - wall, time.process_time() - cpu)
    ranks = allgather(mine)
    if rank == 0:
        images_done = args.batch_size * len(ranks) * (args.steps - args.timing_warmup_steps)
        result = {
            "world_size": len(ranks),
            "images_per_sec": images_done / max(w for w, _ in ranks),
            "images_per_cpu_s": images_done / sum(c for _, c in ranks),
        }
        args.metrics_json.write_text(json.dumps(result))
    exit_worker()


if __name__ == "__main__":
    main()
