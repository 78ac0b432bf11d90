"""One measured run of ``bench.cpu.parallel``, under torchrun: a transformer trained with AdamW by DDP,
by FSDP2 (sharded the way ``training.model_parallel`` shards it), or by one plain process.

The same model, batch and optimizer on every side, and nothing else in the loop (no data loading,
logging or checkpoints), so that the figures compare the parallelism alone. Rank 0 writes the
median step time (the slowest rank's, per step), the parameter bytes each rank stores and each
rank's peak resident memory to ``--metrics-json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from bench.harness.proc import exit_worker
from training.config.models import GPT_CONFIGS, GPTConfig
from training.torch.parallel import memory
from training.torch.parallel.sharding import apply_fsdp, mixed_precision
from training.torch.transformer import build_gpt, init_weights

# A GPT-2-like shape small enough for a CPU step in about a second, large enough that the
# collectives move megabytes (13.8M parameters, 55 MB of fp32 gradients per step).
BENCH_GPT = GPTConfig("bench-gpt", vocab_size=4096, dim=384, n_layers=6, n_heads=6, ffn_dim=1536, max_seq_len=256)
MODELS = {"bench-gpt": BENCH_GPT, "gpt-125m": GPT_CONFIGS["gpt-125m"]}
MODES = ("plain", "ddp", "fsdp")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m bench.cpu.parallel_worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--model", choices=MODELS, default="bench-gpt")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the step time")
    parser.add_argument("--metrics-json", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[args.model]
    if args.mode == "fsdp":
        # Built on the meta device, sharded, then filled: no rank ever holds the whole model, so
        # the peak memory shows what sharding saves (training.model_parallel does this for big models).
        model = build_gpt(cfg, seed=None)
        apply_fsdp(model, init_device_mesh("cpu", (world,)), mixed_precision("fp32"), pipelined=False)
        model.to_empty(device="cpu")
        init_weights(model, cfg.n_layers)
        trained = model
    elif args.mode == "ddp":
        model = build_gpt(cfg, seed=0)
        trained = DistributedDataParallel(model)
    else:  # plain
        if world != 1:
            raise SystemExit("--mode plain is one process")
        model = trained = build_gpt(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(trained(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    _, size = memory.local_parameters([model])
    mine = {"times": times[args.warmup :], "bytes": size, "peak": memory.peak_memory_bytes(torch.device("cpu"))}
    ranks: list[dict] = [{}] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        step_times = [max(column) for column in zip(*(r["times"] for r in ranks), strict=True)]
        result = {
            "mode": args.mode,
            "model": args.model,
            "world_size": world,
            "parameters": sum(p.numel() for p in model.parameters()),
            "step_s": statistics.median(step_times),
            "parameter_bytes_per_rank": [r["bytes"] for r in ranks],
            "peak_memory_bytes_per_rank": [r["peak"] for r in ranks],
        }
        args.metrics_json.write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()  # rank 0 has written the result before any rank leaves
    exit_worker()


if __name__ == "__main__":
    main()
