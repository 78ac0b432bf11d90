"""A test-only wrapper that runs a trainer and records, on each rank, what one training step asks of torch.

Run under torchrun in place of the trainer's module, with the trainer's own flags after it::

    torchrun --standalone --nproc-per-node 2 -m tests.training.op_census OUT_DIR training.pytorch [flags]

Each rank writes ``OUT_DIR/rank<R>.json``: ``ops``, the aten (and c10d, fsdp) operators dispatched in the
third training step, counted by overload name; and ``losses``, every cross-entropy value the rank computed
(``aten.nll_loss_forward``, whatever called it: a whole batch, or a pipeline's microbatches, but not the
pipeline's shape inference), in order.
tests/training/test_trainer_equivalence.py compares them with the figures recorded before a change.

Why these hooks: they see only torch, never the trainer's own functions, so the same census runs
unchanged against the code before and after a refactor of the trainers.

* A ``TorchDispatchMode`` is active for the whole run (it is thread-local: the optimizer step, forward
  and backward of the main thread; collectives that other threads run on their own are not counted).
  It sees each op once, at the level the trainer calls it: a DTensor op is counted as one op, not as
  the local ops and collectives that DTensor runs inside it.
* Training steps are told apart by the optimizer: torch's global step hook fires after every
  ``Optimizer.step``; a rank with several optimizers (a pipeline's virtual stages) steps each once per
  training step, so step ``k`` ends at the ``k * n``-th call, ``n`` the number of distinct optimizers.
  The census window is the third step (``COUNTED_STEP``): after the first two (DDP rebuilds its
  buckets in the first, optimizers create their state) and before the last (which logs and saves).
* The process leaves through ``os._exit`` (training/run/job.py), so each rank writes its file as it goes.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

COUNTED_STEP = 3  # 1-based: the training step whose operators are counted (see the module docstring)
LOSS_OP = torch.ops.aten.nll_loss_forward.default


class Census(TorchDispatchMode):
    """Counts the operators of the window :meth:`optimizer_stepped` opens and closes; keeps every loss."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.counting = False
        self.ops: Counter[str] = Counter()
        self.losses: list[float] = []
        self.optimizer_calls: list[int] = []  # id() of the optimizer of each step call, in order

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.counting:
            self.ops[str(func)] += 1
        if func is LOSS_OP and not in_shape_inference():
            loss = result[0]
            local = loss.to_local() if hasattr(loss, "to_local") else loss  # a DTensor: this rank's value
            self.losses.append(float(local))
            self.write()
        return result

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_calls.append(id(optimizer))
        calls, optimizers = len(self.optimizer_calls), len(set(self.optimizer_calls))
        if calls <= optimizers or calls % optimizers:  # inside step 1 (n not known yet), or mid-step
            return
        done = calls // optimizers
        if done == COUNTED_STEP - 1:
            self.counting = True
        elif done == COUNTED_STEP:
            self.counting = False
            self.write()

    def write(self) -> None:
        counted = dict(sorted(self.ops.items())) if not self.counting else {}
        self.out.write_text(json.dumps({"ops": counted, "losses": self.losses}))


def in_shape_inference() -> bool:
    """Whether torch.distributed.pipelining is inferring its stages' shapes: before the first step it runs the
    last stage's loss on uninitialized tensors (``PipelineStage._backward_metadata_inference``), a value that
    is noise (sometimes nan), not a training loss."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name.endswith("_metadata_inference"):
            return True
        frame = frame.f_back
    return False


def main(argv: list[str]) -> None:
    out_dir, module, *flags = argv
    rank = int(os.environ.get("RANK", "0"))
    census = Census(Path(out_dir) / f"rank{rank}.json")
    register_optimizer_step_post_hook(census.optimizer_stepped)
    sys.argv = [module, *flags]
    with census:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
