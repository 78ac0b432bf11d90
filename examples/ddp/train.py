"""Plain torch.distributed DDP, the way a user writes it: a tiny regression model on synthetic data.

Started once per GPU (or per CPU process) by torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT. NCCL on CUDA, gloo on CPU. Rank 0 writes metrics.json and model.pt
to $OUTPUT_DIR (./output when it is not set), which `launch --workdir` uploads to the results container.

    torchrun --standalone --nproc-per-node 2 train.py --epochs 2
    python -m dtrain launch --workdir examples/ddp --gpus 1 -- python train.py --epochs 2
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FEATURES = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()  # strict: an argument this script did not ask for is an error


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    target = torch.linspace(-1, 1, FEATURES, device=device)
    generator = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own samples
    loss = torch.zeros((), device=device)
    for epoch in range(args.epochs):
        for _ in range(args.steps_per_epoch):
            x = torch.randn(args.batch_size, FEATURES, device=device, generator=generator)
            loss = nn.functional.mse_loss(ddp(x).squeeze(-1), x @ target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch} loss {mean.item() / world:.4f} on {world} processes", flush=True)
    if rank == 0:
        output = Path(os.environ.get("OUTPUT_DIR", "output"))
        output.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), output / "model.pt")
        metrics = {"world_size": world, "final_loss": loss.item(), "argv": sys.argv[1:], "device": device.type}
        (output / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
