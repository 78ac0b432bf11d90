"""The speed choices that CPU runs cannot time but can check: what the jobs wrap, and when."""

from __future__ import annotations

import torch

from training.pytorch import DDPBackend
from training.torch_models import build_model


def test_ddp_backend_does_not_wrap_a_single_process() -> None:
    backend = DDPBackend.__new__(DDPBackend)  # no process group: distribute needs none at world size 1
    backend.size, backend.local_rank = 1, 0
    model = build_model("simple_cnn", 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, same_optimizer = backend.distribute(model, optimizer, fp16_allreduce=False)
    assert wrapped is model and same_optimizer is optimizer
    conv = model[1].weight
    assert conv.is_contiguous(memory_format=torch.channels_last)  # the layout DDP would have set
