"""Checks of :mod:`training.torch.parallel.pipeline` on real processes, for the tests and ``make bench``.

Not a training job. Run under torchrun (gloo on CPU), every rank one pipeline rank:

* ``equivalence``: the small transformer (gpt-tiny, 4 layers) pipelined over the ranks with
  a given schedule and trained with AdamW, against the same model in one piece on every rank,
  from the same weights on the same batches. Per step: the pipeline's loss against a reference
  that trains on its own (the loss trajectory), and the pipeline's loss and gradients (by FQN)
  against a probe given the pipeline's current weights (the same step on the same weights; a
  gradient compared after independent AdamW steps would mostly show Adam amplifying float32
  noise in near-zero gradients).
* ``bubble``: equal stages, one per rank (two for interleaved-1f1b), one thread per process;
  per microbatch count, the median of the measured bubble over the measured steps against
  (p-1)/(v m+p-1). The work per microbatch does not change with the microbatch count. A barrier
  before each step starts every rank's step together, so the measurement sees the schedule's
  fill and drain, not the previous step's tail. Two kinds of stage:

  - ``sleep`` (the acceptance test): forward holds each microbatch 50 ms, backward 100 ms, off
    the CPU, so the stage times are exactly equal and fixed, as the formula assumes, whatever
    else runs on the machine; activations are small (32 x 256 floats), so what is left over is
    the schedule: its order of work, its sends and receives, its Python.
  - ``matmul``: 4 x Linear(1024)+tanh on 128 rows (~8 ms forward on one core). This measures the
    machine as well: on the 2-vCPU CI VM the "equal" stages run 10-20% apart and vary from one
    microbatch to the next, and each 512 KB activation adds about 1 ms on the critical path, so
    it reads well above theory there (see docs/parallelism.md).

:func:`measure_bubbles` launches the bubble check and returns its numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.config.pipeline_schedules import theoretical_bubble
from training.torch.parallel.pipeline import build_pipeline, split_for_pipeline

REPO = Path(__file__).resolve().parents[3]
# Per microbatch. sleep: 50 ms forward, 100 ms backward, small messages (8K floats), so the ~1 ms
# the schedule's Python and gloo spend per microbatch on the critical path stays ~1% of a step.
# matmul: 4 x Linear(1024) on 128 rows, ~8 ms forward on one core of the CI machine.
WORK_DEFAULTS: dict[str, dict[str, float]] = {
    "sleep": {"dim": 256, "rows": 32, "forward_ms": 50.0},
    "matmul": {"dim": 1024, "rows": 128, "depth": 4},
}


def measure_bubbles(
    pp: int,
    microbatches: Sequence[int],
    schedule: str = "gpipe",
    *,
    work: str = "sleep",
    steps: int = 3,
    warmup: int = 1,
    timeout: float = 300,
    **shape: float,
) -> list[dict[str, Any]]:
    """Measured and theoretical bubble for each microbatch count, on ``pp`` local processes.

    ``work``: "sleep" (stages of fixed time: the schedule alone) or "matmul" (stages of fixed
    FLOPs: the schedule on this machine's cores). ``shape`` overrides :data:`WORK_DEFAULTS`.
    Each result: ``{"microbatches", "measured", "theory", "per_step"}``. Raises RuntimeError
    with the run's output when the processes fail.
    """
    options = {**WORK_DEFAULTS[work], **shape}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bubble.json"
        args = ["bubble", "--schedule", schedule, "--work", work, "--microbatches", *map(str, microbatches)]
        args += ["--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        args += [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
        run_torchrun(pp, args, timeout)
        return json.loads(out.read_text())["results"]


def measure_bubble(pp: int, microbatches: int, schedule: str = "gpipe", **kwargs: Any) -> tuple[float, float]:
    """``(measured, theory)`` for one microbatch count."""
    (result,) = measure_bubbles(pp, [microbatches], schedule, **kwargs)
    return result["measured"], result["theory"]


def run_torchrun(nproc: int, args: list[str], timeout: float) -> None:
    # One thread per process: two ranks on two cores, and compute time that does not depend on
    # how many cores a rank's thread pool happens to get.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "training.torch.parallel.pipeline_check", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")


# ---------------------------------------------------------------- equivalence


def tiny_gpt(seed: int) -> nn.Module:
    """gpt-tiny (4 layers: 2 ranks x 2 virtual stages fit), the same weights on every rank."""
    from training.config.models import GPT_CONFIGS
    from training.torch.transformer import build_gpt

    return build_gpt(GPT_CONFIGS["gpt-tiny"], seed)


def token_batch(seed: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def equivalence(args: argparse.Namespace) -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt(args.seed)
    reference = copy.deepcopy(model)  # in one piece, trained on its own: the loss trajectory
    probe = copy.deepcopy(model)  # in one piece, given the pipeline's weights before each step: the gradients
    chunks, stage_ids = split_for_pipeline(model, rank, size, args.schedule)
    pipeline = build_pipeline(
        chunks,
        stage_ids,
        size * len(chunks),
        dist.group.WORLD,
        torch.device("cpu"),
        args.schedule,
        args.microbatches,
        lm_loss,
    )
    mine = {name: p for chunk in chunks for name, p in chunk.named_parameters()}
    optimizers = [
        torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1) for params in (mine.values(), reference.parameters())
    ]
    steps = []
    for step in range(args.steps):
        _load_pipeline_weights(probe, mine)
        steps.append(_compare_step(args, step, pipeline, mine, reference, probe))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    names = sorted(dict(reference.named_parameters()))
    return {"rank": rank, "stage_ids": stage_ids, "names": sorted(mine), "all_names": names, "steps": steps}


def _compare_step(
    args: argparse.Namespace,
    step: int,
    pipeline: Any,
    mine: dict[str, nn.Parameter],
    reference: nn.Module,
    probe: nn.Module,
) -> dict[str, Any]:
    # The same batch every step: the model memorizes it, so the loss falls steadily and matching
    # the reference's trajectory says the updates match (on fresh random tokens it stays at ln 256).
    inputs, targets = token_batch(args.seed, args.batch_size, args.seq_len, probe.output.out_features)
    loss = pipeline.step(inputs, targets)
    ref_loss = lm_loss(reference(inputs), targets)
    ref_loss.backward()
    probe.zero_grad(set_to_none=True)
    probe_loss = lm_loss(probe(inputs), targets)
    probe_loss.backward()
    probe_params = dict(probe.named_parameters())
    return {
        "step": step,
        "loss": None if loss is None else loss.item(),
        "ref_loss": ref_loss.item(),
        "probe_loss": probe_loss.item(),
        "grad_rel_err": max(_relative_error(p.grad, probe_params[name].grad) for name, p in mine.items()),
        "bubble": pipeline.last_bubble_fraction,
    }


def _load_pipeline_weights(probe: nn.Module, mine: dict[str, nn.Parameter]) -> None:
    """Every rank's current chunk weights into ``probe`` (gpt-tiny: a few hundred KB per rank)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: p.detach() for name, p in mine.items()})
    params = dict(probe.named_parameters())
    with torch.no_grad():
        for part in gathered:
            for name, value in part.items():
                params[name].copy_(value)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the tensor's largest magnitude (elementwise relative error
    blows up where a value is near zero, which says nothing about the computation)."""
    scale = expected.detach().abs().max().item()
    return (actual.detach() - expected.detach()).abs().max().item() / max(scale, 1e-30)


# ---------------------------------------------------------------- bubble


class FixedWork(nn.Module):
    """A stage whose compute per microbatch is fixed by its shapes: ``depth`` x Linear(dim)+tanh."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Hold(torch.autograd.Function):
    """Identity that takes ``forward_s`` in forward and ``backward_s`` in backward, off the CPU."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class FixedTime(nn.Module):
    """A stage whose forward takes ``forward_ms`` per microbatch and its backward twice that (the
    usual ratio), whatever else the machine runs: the stage times the formula assumes, exactly.
    It still has a parameter, sends real activations and receives real gradients."""

    def __init__(self, dim: int, forward_ms: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.forward_s = forward_ms / 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hold.apply(x * self.scale, self.forward_s, 2 * self.forward_s)


def bubble(args: argparse.Namespace) -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    per_rank = 2 if args.schedule == "interleaved-1f1b" else 1
    stage_ids = [rank + k * size for k in range(per_rank)]
    torch.manual_seed(args.seed)
    for name, value in WORK_DEFAULTS[args.work].items():
        if getattr(args, name) is None:
            setattr(args, name, type(value)(value))
    if args.work == "matmul":
        chunks: list[nn.Module] = [FixedWork(args.dim, args.depth) for _ in stage_ids]
    else:
        chunks = [FixedTime(args.dim, args.forward_ms) for _ in stage_ids]
    results = []
    for m in args.microbatches:
        pipeline = build_pipeline(
            chunks, stage_ids, size * per_rank, dist.group.WORLD, torch.device("cpu"), args.schedule, m, F.mse_loss
        )
        # Requiring grad makes the first stage compute its input's gradient like the others do:
        # equal stages, as the formula assumes (a real first stage skips it).
        inputs = torch.randn(m * args.rows, args.dim, requires_grad=True)
        targets = torch.zeros(m * args.rows, args.dim)
        fractions = []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            pipeline.step(inputs, targets)
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            if step >= args.warmup:
                fractions.append(pipeline.last_bubble_fraction)
        theory = theoretical_bubble(size, m, args.schedule)
        results.append(
            {"microbatches": m, "measured": statistics.median(fractions), "theory": theory, "per_step": fractions}
        )
    return {"pp": size, "schedule": args.schedule, "results": results}


# ---------------------------------------------------------------- entry


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.torch.parallel.pipeline_check")
    sub = parser.add_subparsers(dest="check", required=True)
    eq = sub.add_parser("equivalence")
    eq.add_argument("--schedule", required=True)
    eq.add_argument("--microbatches", type=int, default=4)
    eq.add_argument("--steps", type=int, default=4)
    eq.add_argument("--batch-size", type=int, default=8)
    eq.add_argument("--seq-len", type=int, default=16)
    eq.add_argument("--lr", type=float, default=3e-3)
    bb = sub.add_parser("bubble")
    bb.add_argument("--schedule", default="gpipe")
    bb.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    bb.add_argument("--steps", type=int, default=3)
    bb.add_argument("--warmup", type=int, default=1)
    bb.add_argument("--work", choices=sorted(WORK_DEFAULTS), default="sleep")
    # Unset: WORK_DEFAULTS for the work.
    bb.add_argument("--dim", type=int)
    bb.add_argument("--rows", type=int)
    bb.add_argument("--depth", type=int)
    bb.add_argument("--forward-ms", type=float)
    for p in (eq, bb):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = equivalence(args) if args.check == "equivalence" else bubble(args)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            payload = {"ranks": gathered} if args.check == "equivalence" else result
            args.out.write_text(json.dumps(payload, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
