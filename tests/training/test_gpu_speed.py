"""On a CUDA GPU (``make test-gpu``): compiling changes no loss beyond bf16 rounding, and every
model-parallel layout trains as one process does there too.

Skipped, with the reason printed, where CUDA is absent (tests/conftest.py); CI is CPU-only and
the CPU versions of these checks are tests/training/test_mp_equivalence.py (compiled FSDP
included) and tests/training/test_training_equivalence.py.

Tolerances. Compiled against eager in bf16: inductor fuses and reorders the element-wise work,
and every bf16 rounding of it differs (relative 4e-3 per value); over 5 AdamW steps that moves
the loss by well under 2%. Layouts against one process on the GPU, fp32 (TF32 is off by default
for matmuls): the CPU tolerance of 1e-6 with room for NCCL's and cuBLAS's summation orders, 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.training.jobs import run, torchrun
from tests.training.test_mp_equivalence import CASES, COMMON, GLOBAL_BATCH, relative_differences

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2
GPU_LAYOUT_TOLERANCE = 1e-5


def metrics_of(tmp: Path, name: str, cmd: list[Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    path = tmp / f"{name}.json"
    run([*cmd, "--metrics-json", path], tmp / f"{name}.log", timeout=600, env=env)
    return json.loads(path.read_text())


@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-125m"])
def test_model_parallel_compiled_matches_eager(tmp_path: Path, model: str) -> None:
    flags = ["--model", model, "--seq-len", 128, "--batch-size", 4, "--steps", 5, "--log-every", 1]
    flags += ["--precision", "bf16", "--timing-warmup-steps", 1]
    losses = {}
    for mode in ("--compile", "--no-compile"):
        metrics = metrics_of(tmp_path, mode, torchrun(1, *flags, mode, module="training.model_parallel"))
        assert metrics["compiled"] == (mode == "--compile") and metrics["device"] != "cpu"
        losses[mode] = metrics["step_losses"]
    differences = relative_differences(losses["--compile"], losses["--no-compile"])
    print(f"{model}: compiled vs eager, relative loss differences per step {[f'{d:.1e}' for d in differences]}")
    assert max(differences) <= BF16_TOLERANCE


def test_resnet_job_compiled_matches_eager(tmp_path: Path) -> None:
    flags = ["--backend", "ddp", "--model", "resnet_tiny", "--image-size", 32, "--batch-size", 32]
    flags += ["--precision", "amp", "--steps", 5, "--log-every", 1, "--timing-warmup-steps", 1]
    final = {}
    for mode in ("--compile", "--no-compile"):
        metrics = metrics_of(tmp_path, mode, torchrun(1, *flags, mode))
        assert metrics["precision"] == "amp_bf16" and metrics["device"] != "cpu"
        final[mode] = metrics["final_loss"]
    assert final["--compile"] == pytest.approx(final["--no-compile"], rel=BF16_TOLERANCE)


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process on the GPU, fp32, the whole batch: what every layout must reproduce."""
    tmp = tmp_path_factory.mktemp("gpu-reference")
    cmd = torchrun(1, *COMMON, "--batch-size", GLOBAL_BATCH, module="training.model_parallel")
    metrics = metrics_of(tmp, "one", cmd)
    assert metrics["device"] != "cpu"
    return metrics


def test_one_gpu_process_matches_one_cpu_process(tmp_path: Path, gpu_reference: dict[str, Any]) -> None:
    cmd = torchrun(1, *COMMON, "--batch-size", GLOBAL_BATCH, module="training.model_parallel")
    cpu = metrics_of(tmp_path, "cpu", cmd, env={"CUDA_VISIBLE_DEVICES": ""})
    assert cpu["device"] == "cpu"
    differences = relative_differences(gpu_reference["step_losses"], cpu["step_losses"])
    print(f"GPU vs CPU, one process: relative loss differences per step {[f'{d:.1e}' for d in differences]}")
    assert max(differences) <= GPU_LAYOUT_TOLERANCE


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_one_process_on_the_gpu(tmp_path: Path, gpu_reference: dict[str, Any], name: str) -> None:
    import torch

    nproc, flags, _ = CASES[name]
    if torch.cuda.device_count() < nproc:  # NCCL refuses two ranks on one GPU
        pytest.skip(f"{name} needs {nproc} CUDA devices, this machine has {torch.cuda.device_count()}")
    metrics = metrics_of(tmp_path, name, torchrun(nproc, *COMMON, *flags, module="training.model_parallel"))
    differences = relative_differences(metrics["step_losses"], gpu_reference["step_losses"])
    print(f"{name} on GPUs: relative loss differences per step {[f'{d:.1e}' for d in differences]}")
    assert max(differences) <= GPU_LAYOUT_TOLERANCE
