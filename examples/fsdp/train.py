"""FSDP2 (torch.distributed.fsdp.fully_shard), the way a user writes it: a small pre-norm transformer
language model on random tokens, every block sharded over all processes.

Started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). On CUDA: NCCL, bf16
parameters with fp32 gradient reduction; on CPU: gloo, fp32. Rank 0 gathers the full (unsharded)
weights and writes model.pt and metrics.json to $OUTPUT_DIR (./output when it is not set).

    torchrun --standalone --nproc-per-node 2 train.py --steps 20
    python -m dtrain launch --workdir examples/fsdp --nodes 2 -- python train.py --steps 20
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device, dtype=x.dtype)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss (returned from forward, as nanoGPT does: FSDP hooks the output)."""
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()  # strict: an argument this script did not ask for is an error


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, heads=4, seq_len=args.seq_len).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    shard = {"mp_policy": policy} if policy else {}
    for block in model.blocks:  # each block its own unit: its parameters are gathered only while it runs
        fully_shard(block, **shard)
    fully_shard(model, **shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    loss = torch.zeros((), device=device)
    for step in range(args.steps):
        # a learnable pattern: each token is the previous one plus one
        start = torch.randint(0, args.vocab, (args.batch_size, 1), device=device, generator=generator)
        tokens = (start + torch.arange(args.seq_len + 1, device=device)) % args.vocab
        loss = model(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} on {world} processes", flush=True)
    # every rank takes part in gathering the shards; rank 0 keeps the whole model
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        output = Path(os.environ.get("OUTPUT_DIR", "output"))
        output.mkdir(parents=True, exist_ok=True)
        torch.save(state, output / "model.pt")
        metrics = {"world_size": world, "final_loss": loss.item(), "argv": sys.argv[1:], "device": device.type}
        (output / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
