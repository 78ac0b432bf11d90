"""2 workers x batch B reach the same weights as 1 worker x batch 2B, step by step.

The 2-worker runs double as each framework's 2-process synthetic-data run (metrics checked).

This holds only if rank 0's initial weights are broadcast (the ranks are seeded differently
on purpose) and gradients are averaged, not summed. The model has no batch norm, SGD has no
momentum or weight decay, and the LR follows the linear scaling rule (base LR x world size).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests.training.jobs import check_common, horovodrun, read_metrics, run, single
from training.checkpoint.files import CheckpointDir, checkpoint_path, read_checkpoint

STEPS = 4
COMMON = [
    "--model", "simple_cnn", "--image-size", "16", "--num-classes", "10", "--steps", STEPS,
    "--momentum", "0", "--weight-decay", "0", "--warmup-epochs", "0",
    "--checkpoint-every", "1", "--keep-checkpoints", STEPS,
]  # fmt: skip


def weights(directory: Path, step: int, framework: str) -> dict[str, np.ndarray]:
    payload = read_checkpoint(checkpoint_path(directory, step)).payload
    if framework == "pytorch":
        import torch

        state = torch.load(io.BytesIO(payload), weights_only=True)["model"]
        return {name: tensor.numpy() for name, tensor in state.items()}
    with np.load(io.BytesIO(payload)) as arrays:
        return {name: arrays[name] for name in arrays.files if name.startswith("model_")}


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow", "keras"])
def test_two_workers_match_one_worker_with_double_batch(tmp_path: Path, framework: str) -> None:
    two, one, metrics_path = tmp_path / "two", tmp_path / "one", tmp_path / "metrics.json"
    cmd = horovodrun(2, framework, *COMMON, "--batch-size", 4, "--lr", 0.05, "--checkpoint-dir", two)
    run([*cmd, "--metrics-json", metrics_path], tmp_path / "2.log")
    run(single(framework, *COMMON, "--batch-size", 8, "--lr", 0.1, "--checkpoint-dir", one), tmp_path / "1.log")
    # The 2-worker run is also this framework's 2-process synthetic-data run: its report must hold.
    metrics = read_metrics(metrics_path)
    check_common(metrics, framework)
    assert (metrics["steps"], metrics["precision"], metrics["skipped_images"]) == (STEPS, "fp32", None)
    assert CheckpointDir(two).steps() == CheckpointDir(one).steps() == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        difference = max_difference(weights(two, step, framework), weights(one, step, framework))
        assert difference < 1e-5, f"step {step}: weights differ by {difference}"
    # The comparison means something only if training moved the weights well beyond the tolerance.
    assert max_difference(weights(one, 1, framework), weights(one, STEPS, framework)) > 1e-3
