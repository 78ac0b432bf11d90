"""The speed choices that CPU runs cannot time but can check: what the jobs wrap, and when."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.config.activation_checkpointing import AC_MODES
from training.config.models import GPT_CONFIGS
from training.data.imagenet import MEAN, STD
from training.pytorch import DDPBackend
from training.torch.models import Normalize, build_model
from training.torch.parallel.sharding import apply_activation_checkpointing, blocks
from training.torch.profiling import PROFILED_STEPS, StepProfiler
from training.torch.transformer import build_gpt


def test_ddp_backend_does_not_wrap_a_single_process() -> None:
    backend = DDPBackend.__new__(DDPBackend)  # no process group: distribute needs none at world size 1
    backend.size, backend.local_rank = 1, 0
    model = build_model("simple_cnn", 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, same_optimizer = backend.distribute(model, optimizer, fp16_allreduce=False)
    assert wrapped is model and same_optimizer is optimizer
    conv = model[1].weight
    assert conv.is_contiguous(memory_format=torch.channels_last)  # the layout DDP would have set


class ComputingOps(TorchDispatchMode):
    """The aten operators that run, views left out (they move no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_normalize_is_one_pass_over_the_batch_and_equals_the_plain_form() -> None:
    images = torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    normalize = Normalize()
    with ComputingOps() as ops:
        normalized = normalize(images)
    assert ops.names == ["addcmul.default"]  # no float copy of the batch before it
    plain = (images.permute(0, 3, 1, 2).float() - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1
    )
    assert normalized.dtype == torch.float32 and normalized.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(normalized, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", AC_MODES)
def test_activation_checkpointing_compiles_as_whole_graphs(mode: str) -> None:
    """Each block, with its checkpointed forward, traces as one graph (fullgraph: a break is an
    error) forward and backward, and computes what the eager model does. ``aot_eager`` runs
    dynamo and AOT autograd (where selective checkpointing acts) without inductor's slow codegen;
    tests/training/test_mp_equivalence.py runs the inductor build inside FSDP."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for compiled in (False, True):
        model = build_gpt(GPT_CONFIGS["gpt-tiny"], 0)
        apply_activation_checkpointing(model, mode)
        if compiled:
            for block in blocks(model):
                block.compile(backend="aot_eager", fullgraph=True, dynamic=False)
        model(tokens).float().square().mean().backward()
        grads.append([param.grad for param in model.parameters()])
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


def test_profile_dir_writes_a_trace_of_the_steps_after_the_warmup(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    profiler = StepProfiler(tmp_path / "profile", rank=0, warmup_steps=2)
    for _ in range(2 + PROFILED_STEPS + 2):
        model(torch.randn(4, 8)).sum().backward()
        profiler.step()
    profiler.stop()
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    steps = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {f"ProfilerStep#{step}" for step in range(2, 2 + PROFILED_STEPS)}  # 0-based: after 2 warmup steps
