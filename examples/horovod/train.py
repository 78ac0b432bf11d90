"""Horovod with PyTorch, the way a user writes it: a tiny regression model on synthetic data.

Started once per GPU (or per CPU process) by horovodrun; Horovod's own rendezvous gives each process
its rank (hvd.rank(), hvd.size(), hvd.local_rank()). NCCL on CUDA (if Horovod was built with it),
gloo otherwise. Rank 0 writes metrics.json and model.pt to $OUTPUT_DIR (./output when it is not set).

    horovodrun -np 2 -H localhost:2 --gloo python train.py --epochs 2
    python -m dtrain launch --workdir examples/horovod --launcher horovodrun -- python train.py --epochs 2
"""

import argparse
import json
import os
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

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
    hvd.init()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    # the learning rate scaled by the number of processes, as Horovod's documentation does
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    target = torch.linspace(-1, 1, FEATURES, device=device)
    generator = torch.Generator(device=device).manual_seed(1000 + hvd.rank())
    loss = torch.zeros((), device=device)
    for epoch in range(args.epochs):
        for _ in range(args.steps_per_epoch):
            x = torch.randn(args.batch_size, FEATURES, device=device, generator=generator)
            loss = nn.functional.mse_loss(model(x).squeeze(-1), x @ target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mean = hvd.allreduce(loss.detach(), name="loss")  # the mean over the processes
        if hvd.rank() == 0:
            print(f"epoch {epoch} loss {mean.item():.4f} on {hvd.size()} processes", flush=True)
    if hvd.rank() == 0:
        output = Path(os.environ.get("OUTPUT_DIR", "output"))
        output.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), output / "model.pt")
        metrics = {"world_size": hvd.size(), "final_loss": loss.item(), "argv": sys.argv[1:], "device": device.type}
        (output / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    hvd.shutdown()


if __name__ == "__main__":
    main()
