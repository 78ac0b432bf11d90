"""training.model_parallel's settings: one frozen dataclass, built once from the parsed flags.

As torchtitan's job config, the flags become typed values in one place (:meth:`from_args`, right
after parsing and checking them) and every part of the job reads those, never the argparse
Namespace. Two values depend on the device and the layout, which are known only once the process
group is up: ``--compile`` (default: on with CUDA) and ``--activation-checkpointing auto`` (from
the memory estimate). :meth:`for_device` resolves them into a new settings object; the run trains,
and its metrics report, with that one.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from training.config.settings import ReportingSettings
from training.torch.parallel import memory
from training.torch.parallel.layout import Layout
from training.torch.transformer import GPT_CONFIGS, GPTConfig


@dataclass(frozen=True)
class ModelParallelSettings(ReportingSettings):
    """Every flag of training.model_parallel, typed (the reporting ones inherited); see its ``--help``."""

    # model and layout
    model: str
    tp: int
    pp: int
    dp_shard: int  # -1: every rank left
    pp_schedule: str
    microbatches: int  # per pipeline step (the default is filled in)
    activation_checkpointing: str  # "auto" until for_device(), then none, selective or full
    compile: bool | None  # None (the device decides) until for_device()
    profile_dir: Path | None
    precision: str  # fp32 or bf16
    # data
    data: str  # synthetic or text
    data_dir: Path | None
    seq_len: int | None  # the transformers' (default filled in); None for ResNets
    image_size: int
    num_classes: int
    # schedule
    batch_size: int  # per data-parallel replica
    steps: int
    optimizer: str
    lr: float
    weight_decay: float
    # checkpoints and export
    checkpoint_dir: Path | None
    checkpoint_every: int | None
    keep_checkpoints: int
    export_dir: Path | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelParallelSettings:
        """The settings of flags that ``training.model_parallel.parse_args`` has parsed and checked."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})

    @property
    def gpt(self) -> GPTConfig | None:
        """The transformer's configuration; None for a ResNet."""
        return GPT_CONFIGS.get(self.model)

    @property
    def resolved(self) -> bool:
        """Whether :meth:`for_device` has fixed ``compile`` and ``activation_checkpointing``."""
        return self.compile is not None and self.activation_checkpointing != "auto"

    def for_device(self, layout: Layout, device: torch.device) -> ModelParallelSettings:
        """These settings with ``--compile`` and ``--activation-checkpointing auto`` resolved for ``device``."""
        checkpointing = memory.choose_activation_checkpointing(
            self.activation_checkpointing,
            self.gpt,
            layout,
            self.batch_size,
            self.seq_len,
            self.precision,
            memory.device_memory_bytes(device),
        )
        compile_blocks = device.type == "cuda" if self.compile is None else self.compile
        return dataclasses.replace(self, compile=compile_blocks, activation_checkpointing=checkpointing)
