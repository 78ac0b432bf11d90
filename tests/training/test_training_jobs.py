"""Each job runs as 2 real processes (horovodrun over gloo, torchrun for DDP) and reports
the metrics schema; the ImageNet path decodes a generated JPEG tree with a corrupt file.

TensorFlow and Keras run 2 workers on synthetic data in the equivalence test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.jobs import (
    TINY,
    check_common,
    error_lines,
    horovodrun,
    make_imagenet,
    read_metrics,
    run,
    single,
    torchrun,
)


def test_pytorch_amp_and_fp16_allreduce_on_synthetic_data(tmp_path: Path) -> None:
    metrics_path = tmp_path / "metrics.json"
    options = ["--precision", "amp", "--fp16-allreduce", "--steps", 12, "--timing-warmup-steps", 4]
    output = run(horovodrun(2, "pytorch", *TINY, *options, "--metrics-json", metrics_path), tmp_path / "job.log")
    metrics = read_metrics(metrics_path)
    check_common(metrics, "pytorch")
    assert metrics["steps"] == 12 and metrics["epochs"] == 1
    assert metrics["warmup_steps_excluded"] == 4
    assert metrics["precision"] == "amp_bf16"  # bfloat16 autocast on CPU
    assert metrics["val_top1"] is None and metrics["skipped_images"] is None and metrics["decoder"] is None
    assert "step 10/12" in output  # rank 0 logs every --log-every steps


# --decode auto on a CPU-only machine: the CPU path, without a word.
IMAGENET_OPTIONS = {
    "pytorch": ["--decode", "auto"],
    "tensorflow": ["--precision", "amp"],
    "keras": ["--fp16-allreduce"],
}


@pytest.mark.parametrize("framework", IMAGENET_OPTIONS)
def test_imagenet_layout_with_a_corrupt_file(tmp_path: Path, framework: str) -> None:
    # 16 train files = 2 ranks x batch 4 x 2 steps: every file is read once, the corrupt one too.
    data = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=8, val_per_class=3)
    metrics_path = tmp_path / "metrics.json"
    options = IMAGENET_OPTIONS[framework]
    cmd = horovodrun(2, framework, *TINY, *options, "--data", "imagenet", "--data-dir", data)
    output = run([*cmd, "--metrics-json", metrics_path], tmp_path / "job.log")
    metrics = read_metrics(metrics_path)
    check_common(metrics, framework)
    assert metrics["precision"] == ("amp_bf16" if "amp" in options else "fp32")
    assert metrics["steps"] == 2  # one pass over each rank's 8-image shard
    assert metrics["skipped_images"] == 1
    assert metrics["decoder"] == "simplejpeg + OpenCV"
    assert "n00000000_0.JPEG" in output  # the skip is logged with the file's path
    assert 0.0 <= metrics["val_top1"] <= 1.0


def test_ddp_backend_under_torchrun(tmp_path: Path) -> None:
    metrics_path = tmp_path / "metrics.json"
    cmd = torchrun(2, *TINY, "--backend", "ddp", "--steps", 8, "--fp16-allreduce", "--metrics-json", metrics_path)
    run(cmd, tmp_path / "job.log")
    metrics = read_metrics(metrics_path)
    check_common(metrics, "pytorch", backend="ddp")
    assert metrics["steps"] == 8 and metrics["precision"] == "fp32"


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow", "keras"])
def test_missing_data_dir_is_named(tmp_path: Path, framework: str) -> None:
    missing = tmp_path / "no-such-imagenet"
    output = run(
        single(framework, *TINY, "--data", "imagenet", "--data-dir", missing), tmp_path / "job.log", expect_rc=2
    )
    assert error_lines(output) == [f"error: data directory {missing} does not exist"]
    assert "Traceback" not in output


def test_gpu_decode_without_a_gpu_is_refused(tmp_path: Path) -> None:
    data = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=4, val_per_class=1, corrupt=0)
    cmd = single("pytorch", *TINY, "--data", "imagenet", "--data-dir", data, "--decode", "gpu")
    output = run(cmd, tmp_path / "job.log", expect_rc=2)
    assert error_lines(output) == [
        "error: --decode gpu needs a CUDA device and this process has none: use --decode cpu or auto"
    ]
