"""The data-parallel jobs' settings: one frozen dataclass, built once from the parsed flags.

As torchtitan's job config (and training.torch.parallel.settings for training.model_parallel), the
flags of training.pytorch, training.tensorflow and training.keras become typed values in one
place (:meth:`TrainingSettings.from_args`, right after :func:`training.config.args.parse_args` has
checked them); the data, loop, checkpoint, export and output code reads those, never the
argparse Namespace. The PyTorch-only flags are fields too: TensorFlow and Keras get what their
jobs do (Horovod, every-step synchronisation, no --decode/--compile/--profile-dir).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.config.args import parse_args
from training.torch.sync import SyncSettings

# The fields of flags only training.pytorch has, and their value in the other jobs.
_PYTORCH_ONLY = {"decode": None, "compile": None, "profile_dir": None, "backend": "horovod"}


@dataclass(frozen=True)
class ReportingSettings:
    """The reporting flags every job has (:func:`training.config.args.add_reporting`)."""

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
    """Every flag of a data-parallel job, typed (the reporting ones inherited); see its ``--help``."""

    framework: str  # pytorch, tensorflow or keras
    # data
    data: str  # synthetic or imagenet
    data_dir: Path | None
    image_size: int
    num_classes: int | None  # None: 1000 for synthetic data, the class folders for ImageNet
    data_workers: int | None  # None: from the node's CPUs
    decode: str | None  # PyTorch: cpu, gpu or auto; None elsewhere
    model: str
    # schedule
    batch_size: int  # per worker
    epochs: int
    steps: int | None  # instead of epochs
    base_lr: float
    warmup_epochs: float
    lr_decay_epochs: tuple[float, ...]
    momentum: float
    weight_decay: float
    # speed and synchronisation
    precision: str  # fp32 or amp
    fp16_allreduce: bool
    compile: bool | None  # PyTorch; None: on with CUDA
    profile_dir: Path | None  # PyTorch
    backend: str  # horovod or ddp (PyTorch only)
    sync: SyncSettings  # every-step but with PyTorch's --sync
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
        given = {"framework": framework, "sync": SyncSettings.from_args(args)}
        for field in dataclasses.fields(cls):
            if field.name in given:
                continue
            if field.name in _PYTORCH_ONLY:
                given[field.name] = getattr(args, field.name, _PYTORCH_ONLY[field.name])
            else:
                given[field.name] = getattr(args, field.name)
        return cls(**given)


def parse_settings(framework: str, argv: Sequence[str] | None = None) -> TrainingSettings:
    """A data-parallel job's settings, built once from its flags (exit 2 on a bad flag)."""
    return TrainingSettings.from_args(framework, parse_args(framework, argv))
