"""One model across nodes, started by your own torchrun on each node (task.yaml, per-node mode).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK from the rendezvous that task.yaml passes it
(DTRAIN_NODE_RANK, MASTER_ADDR, MASTER_PORT). Every rank saves its copy of the weights to
$OUTPUT_DIR/replica-<rank>.pt, which must all be equal: one model, not a model per process. The secret
HF_TOKEN is only checked for (its SHA-256 goes to metrics.json), never printed.

    torchrun --standalone --nproc-per-node 2 train.py --steps 20      # on one machine
    dtrain launch examples/torchrun/task.yaml                         # on the cluster
"""

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    steps = parser.parse_args().steps
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(rank)  # different initial weights on purpose: DDP must make them one model
    model = DistributedDataParallel(nn.Linear(8, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator(device=device).manual_seed(rank)  # each rank its own samples
    for _ in range(steps):
        x = torch.randn(16, 8, device=device, generator=data)
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    output = Path(os.environ.get("OUTPUT_DIR", "output"))
    output.mkdir(parents=True, exist_ok=True)
    torch.save(model.module.state_dict(), output / f"replica-{rank}.pt")
    if rank == 0:
        token = os.environ.get("HF_TOKEN", "")
        print(f"{world} processes on {os.environ.get('DTRAIN_NUM_NODES', '1')} nodes, loss {loss.item():.4f}")
        metrics = {"world_size": world, "steps": steps, "hf_token_sha256": hashlib.sha256(token.encode()).hexdigest()}
        (output / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
