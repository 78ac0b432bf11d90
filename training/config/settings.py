"""The jobs' settings: one frozen dataclass with sections, built once from the parsed flags.

As torchtitan's job config, the flags of training.pytorch, training.model_parallel, training.tensorflow
and training.keras become typed values in one place (:meth:`TrainingSettings.from_args`, right after
:func:`training.config.args.parse_args` has checked them and filled in the defaults that depend on the
model); the data, loop, checkpoint, export and output code reads those, never the argparse Namespace.
Sections group what belongs together: the parallel layout, the optimizer and its LR schedule, and the
replicas' synchronisation. The PyTorch-only flags are fields too: TensorFlow and Keras get what their jobs
do (Horovod, SGD, every-step synchronisation, no layout, no --decode/--compile/--profile-dir).

Runs wherever a job runs. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.config.activation_checkpointing import AUTO
from training.config.args import SGD, parse_args
from training.config.models import GPT_CONFIGS, GPTConfig
from training.config.pipeline_schedules import stages_per_rank
from training.config.sync import SyncSettings

# The fields of flags only PyTorch's parser has, and their value in the other jobs.
_PYTORCH_ONLY = {"decode": None, "compile": None, "profile_dir": None, "backend": "horovod", "seq_len": None}


@dataclass(frozen=True)
class ParallelSettings:
    """The layout (PyTorch): none of ``--tp``, ``--pp``, ``--dp-shard`` is data parallelism by replication."""

    tp: int = 1
    pp: int = 1
    dp_shard: int | None = None  # None: not given; -1: every rank left after tp and pp
    pp_schedule: str | None = None  # with pp > 1 (the default filled in)
    microbatches: int | None = None  # per pipeline step, with pp > 1 (the default filled in)
    activation_checkpointing: str = AUTO  # "auto" until the device is known, then none, selective or full

    @property
    def mesh(self) -> bool:
        """Whether the flags ask for a DeviceMesh layout rather than plain replication."""
        return self.tp > 1 or self.pp > 1 or self.dp_shard is not None

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds: 1 without --pp, 2 with interleaved-1f1b."""
        return stages_per_rank(self.pp_schedule) if self.pp > 1 and self.pp_schedule else 1

    def flags(self) -> str:
        """The layout flags given, as typed (for messages)."""
        given = [f"--tp {self.tp}"] if self.tp > 1 else []
        given += [f"--pp {self.pp}"] if self.pp > 1 else []
        given += [f"--dp-shard {self.dp_shard}"] if self.dp_shard is not None else []
        return " ".join(given)


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and its LR schedule (:func:`training.run.schedule.learning_rate`); the defaults that
    depend on the model and the optimizer are filled in by the parser (training.config.args.OPTIMIZER_DEFAULTS)."""

    name: str  # sgd or adamw
    lr: float  # for one data-parallel replica's batch
    momentum: float | None  # SGD's; None with AdamW
    weight_decay: float
    warmup_epochs: float
    lr_decay_epochs: tuple[float, ...]  # empty: no decay

    def lr_scale(self, replicas: int) -> int:
        """What the LR is multiplied by after the warmup: the replicas for SGD (the linear scaling rule of
        Goyal et al., whose batch grows with them), 1 for AdamW (whose updates are normalized)."""
        return replicas if self.name == SGD else 1


@dataclass(frozen=True)
class ReportingSettings:
    """The reporting flags every job has (:func:`training.config.args._add_reporting`)."""

    metrics_json: Path | None
    tensorboard_dir: Path | None
    summary_png: Path | None
    slow_ranks_json: Path | None
    seed: int
    log_every: int | None  # None: args.log_interval's default, once the run's steps are known
    timing_warmup_steps: int
    debug: bool


@dataclass(frozen=True)
class TrainingSettings(ReportingSettings):
    """Every flag of a job, typed (the reporting ones inherited, the sections' in their own); see its ``--help``."""

    framework: str  # pytorch, tensorflow or keras
    # data
    data: str  # synthetic, imagenet or text (transformers)
    data_dir: Path | None
    image_size: int
    num_classes: int | None  # None: 1000 for synthetic data, the class folders for ImageNet
    data_workers: int | None  # None: from the node's CPUs
    decode: str | None  # PyTorch: cpu, gpu or auto; None elsewhere
    seq_len: int | None  # the transformers' (default filled in); None for image models
    model: str
    # schedule
    batch_size: int  # per data-parallel replica (default filled in)
    epochs: int
    steps: int | None  # instead of epochs
    # sections
    parallel: ParallelSettings
    optimizer: OptimizerSettings
    sync: SyncSettings  # every-step but with PyTorch's --sync
    # speed
    precision: str  # fp32, amp or bf16 (PyTorch)
    fp16_allreduce: bool
    compile: bool | None  # PyTorch; None: on with CUDA (resolved by the trainer for its device)
    profile_dir: Path | None  # PyTorch
    backend: str  # horovod or ddp (PyTorch only)
    # checkpoints and export
    checkpoint_dir: Path | None
    checkpoint_every: int | None  # None: every epoch
    keep_checkpoints: int
    ignore_bad_checkpoints: bool
    export_dir: Path | None
    export_every_epoch: bool

    @classmethod
    def from_args(cls, framework: str, args: argparse.Namespace) -> TrainingSettings:
        """The settings of flags that :func:`training.config.args.parse_args` has parsed and checked."""
        given = {
            "framework": framework,
            "sync": SyncSettings.from_args(args),
            "optimizer": OptimizerSettings(
                name=args.optimizer,
                lr=args.lr,
                momentum=args.momentum,
                weight_decay=args.weight_decay,
                warmup_epochs=args.warmup_epochs,
                lr_decay_epochs=args.lr_decay_epochs,
            ),
            "parallel": ParallelSettings(
                **{field.name: getattr(args, field.name) for field in dataclasses.fields(ParallelSettings)}
            )
            if framework == "pytorch"
            else ParallelSettings(),
        }
        for field in dataclasses.fields(cls):
            if field.name in given:
                continue
            if field.name in _PYTORCH_ONLY:
                given[field.name] = getattr(args, field.name, _PYTORCH_ONLY[field.name])
            else:
                given[field.name] = getattr(args, field.name)
        return cls(**given)

    @property
    def gpt(self) -> GPTConfig | None:
        """The transformer's configuration; None for an image model."""
        return GPT_CONFIGS.get(self.model)

    @property
    def resolved(self) -> bool:
        """Whether the trainer has fixed ``compile`` and ``activation_checkpointing`` for its device."""
        return self.compile is not None and self.parallel.activation_checkpointing != AUTO


def parse_settings(framework: str, argv: Sequence[str] | None = None, prog: str | None = None) -> TrainingSettings:
    """A job's settings, built once from its flags (exit 2 on a bad flag); ``prog``: the command its
    errors name."""
    return TrainingSettings.from_args(framework, parse_args(framework, argv, prog=prog))
