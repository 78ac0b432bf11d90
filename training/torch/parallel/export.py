"""The whole model of a sharded or pipelined run, gathered into one export (:mod:`training.run.export`).

Each pipeline stage's first rank (data-parallel and tensor-parallel coordinates 0) rebuilds its
stage's full tensors one at a time (``DTensor.full_tensor``, a collective over the tensor's mesh,
so a GPU never holds more than the stage's shards plus one whole tensor) and keeps them on the CPU;
global rank 0 gathers the stages' parts (disjoint keys: the split keeps the model's names), builds
the unsharded model and writes it as the data-parallel job would:

* ResNets: ``model.pt2`` (torch.export), which ``training.predict`` reads;
* transformers: ``model.pt2`` (its ``state_dict`` loads into :func:`training.torch.transformer.build_gpt`), a
  torch.export program from token ids ``[batch, seq_len]`` (int64) to logits; ``model.json`` says
  ``"task": "causal-lm"`` with the configuration and the tokenizer (bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from training.config.layout import Layout
from training.config.models import SYNTHETIC_CLASSES, GPTConfig
from training.config.settings import TrainingSettings
from training.pytorch import export_model
from training.run.export import ExportSpec, ModelFiles, model_card, model_json, write_export
from training.torch.models import build_model
from training.torch.transformer import build_gpt

StateDict = dict[str, torch.Tensor]


def gather_full_state_dict(chunks: Sequence[nn.Module], layout: Layout, rank: int) -> StateDict | None:
    """The whole model's state dict on the CPU of global rank 0; None on the other ranks.
    Collective: every rank calls it."""
    coordinates = layout.coordinates(rank)
    writer = all(index == 0 for dim, index in coordinates.items() if dim != "pp")
    part: StateDict = {}
    for chunk in chunks:
        for name, value in get_model_state_dict(chunk).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if writer:
                part[name] = full.detach().to("cpu", copy=True)
    gathered: list[StateDict | None] | None = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(part if writer else None, gathered, dst=0)
    if gathered is None:
        return None
    return {name: tensor for stage in gathered if stage for name, tensor in stage.items()}


def save_gpt(cfg: GPTConfig, state: StateDict, seq_len: int, directory: Path) -> ModelFiles:
    """A torch.export program (token ids in, logits out) of the whole model: the one copy of its weights
    (``torch.export.load(path).state_dict`` has the model's own names)."""
    with torch.device("meta"):
        model = build_gpt(cfg, None)
    model.load_state_dict(state, assign=True)  # the gathered tensors become the parameters: no copy
    model.eval()
    example = torch.zeros(2, seq_len, dtype=torch.int64)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    torch.export.save(program, directory / "model.pt2")
    return ModelFiles("torch.export", "model.pt2", "logits")


def language_model_card(cfg: GPTConfig, seq_len: int, tokenizer: str) -> dict[str, Any]:
    """What model.json adds for a transformer, in place of an image classifier's classes and preprocessing."""
    return {
        "task": "causal-lm",
        "config": dataclasses.asdict(cfg),
        "seq_len": seq_len,
        "tokenizer": tokenizer,
        "input": {"dtype": "int64", "shape": [None, seq_len]},
    }


def write_whole_model(settings: TrainingSettings, state: StateDict, metrics: Mapping[str, Any]) -> None:
    """Rank 0: the export of ``--model`` with the gathered ``state`` into ``--export-dir``."""
    cfg = settings.gpt
    if cfg is None:
        width = settings.num_classes or SYNTHETIC_CLASSES
        model = build_model(settings.model, width)
        model.load_state_dict(state)
        classes = [f"class_{i}" for i in range(width)]  # synthetic images have no class names
        spec = ExportSpec("pytorch", settings.model, classes, settings.image_size)
        write_export(
            settings.export_dir,
            partial(export_model, model, settings.image_size),
            lambda files: model_card(spec, files, metrics),
        )
        return
    tokenizer = "bytes" if settings.data == "text" else f"synthetic token ids 0..{cfg.vocab_size - 1}"
    task = language_model_card(cfg, settings.seq_len, tokenizer)
    write_export(
        settings.export_dir,
        partial(save_gpt, cfg, state, settings.seq_len),
        lambda files: model_json("pytorch", settings.model, files, task, metrics),
    )
