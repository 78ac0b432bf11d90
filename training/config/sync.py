"""The synchronisation settings of the PyTorch data-parallel job: the ``--sync`` modes, their defaults, the
typed :class:`SyncSettings` and the refusal of flags that cannot run together.

Framework-free, so that the parser (training/config/args.py) reads them without importing torch; what the
modes do to a DDP model (torch's hook, averager and DiLoCo's outer step) is training/torch/sync.py.

Runs wherever a job runs. Standard library only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

EVERY_STEP, LOCAL_SGD, HIERARCHICAL = "every-step", "local-sgd", "hierarchical"
SYNC_MODES = (EVERY_STEP, LOCAL_SGD, HIERARCHICAL)
AVERAGE, NESTEROV = "average", "nesterov"
OUTER_OPTIMIZERS = (AVERAGE, NESTEROV)
DEFAULT_SYNC_EVERY = 8
DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's


@dataclass(frozen=True)
class SyncSettings:
    """The job's synchronisation settings, built once from the flags (:meth:`from_args`)."""

    mode: str = EVERY_STEP
    every: int = 1  # H: steps between two averages over every rank
    warmup_steps: int = 0  # fully synchronous steps first
    outer: str = AVERAGE
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SyncSettings:
        """The settings of parsed flags (:func:`sync_refusal` has accepted them)."""
        mode = getattr(args, "sync", EVERY_STEP)
        if mode == EVERY_STEP:
            return cls()
        return cls(
            mode=mode,
            every=args.sync_every or DEFAULT_SYNC_EVERY,
            warmup_steps=args.sync_warmup_steps or 0,
            outer=args.outer_optimizer,
            outer_lr=DEFAULT_OUTER_LR if args.outer_lr is None else args.outer_lr,
            outer_momentum=DEFAULT_OUTER_MOMENTUM if args.outer_momentum is None else args.outer_momentum,
        )

    @property
    def periodic(self) -> bool:
        """Whether replicas take local steps (and differ between averages)."""
        return self.mode != EVERY_STEP

    def global_average_due(self, done: int) -> bool:
        """Whether the parameters are averaged over every rank once ``done`` steps are done:
        PeriodicModelAverager's rule, with its step counter = steps done."""
        return self.periodic and done >= self.warmup_steps and (done - self.warmup_steps) % self.every == 0

    def describe(self) -> str:
        if not self.periodic:
            return EVERY_STEP
        outer = "" if self.outer == AVERAGE else f", outer Nesterov lr {self.outer_lr} momentum {self.outer_momentum}"
        return f"{self.mode} every {self.every} steps after {self.warmup_steps} synchronous{outer}"


def sync_refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot run together, or None. For the argument parser: one line, exit 2."""
    mode = getattr(args, "sync", None)
    if mode is None:  # a job without the flags (TensorFlow, Keras)
        return None
    if mode == EVERY_STEP:
        given = [flag for flag, value in _periodic_flags(args).items() if value is not None]
        if given:
            return f"{', '.join(given)}: only used with --sync local-sgd or hierarchical"
        return None
    if args.backend != "ddp":
        return (
            f"--sync {mode} needs --backend ddp (torchrun): Horovod's DistributedOptimizer allreduces "
            "every step, and Horovod has no model averager"
        )
    if args.fp16_allreduce:
        return f"--fp16-allreduce compresses the per-step gradient allreduce, which --sync {mode} does not do"
    if args.outer_optimizer != NESTEROV and (args.outer_lr is not None or args.outer_momentum is not None):
        return "--outer-lr and --outer-momentum only apply to --outer-optimizer nesterov"
    if args.outer_lr is not None and args.outer_lr <= 0:
        return f"--outer-lr {args.outer_lr}: must be above 0 (0 would keep the weights where they started)"
    if args.outer_momentum is not None and not 0 <= args.outer_momentum < 1:
        return f"--outer-momentum {args.outer_momentum}: must be at least 0 and below 1 (1 or more diverges)"
    return None


def _periodic_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "--sync-every": args.sync_every,
        "--sync-warmup-steps": args.sync_warmup_steps,
        "--outer-optimizer": None if args.outer_optimizer == AVERAGE else args.outer_optimizer,
        "--outer-lr": args.outer_lr,
        "--outer-momentum": args.outer_momentum,
    }
