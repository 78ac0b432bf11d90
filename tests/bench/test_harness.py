"""The baseline pipeline's fidelity to torchvision, unit conversions, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from bench.__main__ import staging_figures
from bench.cpu import tv_baseline
from bench.cpu.allreduce import bus_gbps
from bench.harness.results import INFO, PASS


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (2000, 100)])
def test_random_resized_crop_params_stay_inside_the_image(size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    img = Image.new("RGB", size)
    for _ in range(200):
        top, left, h, w = tv_baseline.rrc_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
        assert top >= 0 and left >= 0 and h > 0 and w > 0
        assert top + h <= size[1] and left + w <= size[0]


def test_extreme_aspect_falls_back_to_a_centre_crop_at_the_ratio_limit() -> None:
    top, left, h, w = tv_baseline.rrc_params(Image.new("RGB", (2000, 100)), (0.99, 1.0), (3 / 4, 4 / 3))
    assert (h, w) == (100, 133) and left == (2000 - 133) // 2 and top == 0


def test_transform_is_to_tensor_then_imagenet_normalize() -> None:
    mean = [round(m * 255) for m in tv_baseline.IMAGENET_MEAN]
    img = Image.fromarray(np.full((60, 80, 3), mean, np.uint8))
    out = tv_baseline.TrainTransform(32)(img)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    assert out.abs().max() < 0.01  # the mean colour normalizes to about 0
    white = tv_baseline.TrainTransform(8)(Image.new("RGB", (20, 20), (255, 255, 255)))
    expected = [(1 - m) / s for m, s in zip(tv_baseline.IMAGENET_MEAN, tv_baseline.IMAGENET_STD, strict=True)]
    assert white[:, 0, 0].tolist() == pytest.approx(expected, rel=1e-5)


def test_two_rank_bus_bandwidth_is_bytes_over_time() -> None:
    assert bus_gbps(2e9, 1.0) == pytest.approx(2.0)


def test_staging_figures_compare_each_of_ours_with_the_sequential_loop() -> None:
    raw = {
        "files": 10,
        "bytes": 10e6,
        "seconds": {
            "sequential": [10.0, 10.0],
            "sequential_server_cpu": [5.0, 5.0],
            "sequential_client_cpu": [1.0, 1.0],
            "ours": [4.0, 5.0],
            "ours_server_cpu": [4.0, 5.0],
            "ours_client_cpu": [2.0, 2.5],
            "ours_sharded": [1.0, 2.0],
            "ours_sharded_server_cpu": [0.5, 1.0],
            "ours_sharded_client_cpu": [0.5, 1.0],
        },
    }
    requests, sharded = staging_figures(raw)
    assert (requests.key, sharded.key) == ("staging_requests", "staging_sharded")
    # 10 files: ours 2.5 and 2.0 requests/s against the loop's 1.0; information, no goal
    assert (requests.ours, requests.baseline, requests.ratio) == (pytest.approx(2.25), 1.0, pytest.approx(2.25))
    assert (requests.unit, requests.status) == ("requests/s", INFO)
    # client CPU per request: median 2.25 s / 10 files, against 1 s / 10
    assert requests.note.startswith("client CPU per request: ours 225.00 ms, loop 100.00 ms;")
    assert requests.note.endswith("ours 1.00/0.50, loop 0.50/0.10")
    assert (sharded.ratio, sharded.status) == (pytest.approx(7.5), PASS)


def test_cli_help_names_every_section_and_quick_mode() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, check=True).stdout
    for word in (
        "--quick",
        "--only",
        "allreduce",
        "overhead",
        "comm",
        "pipeline",
        "staging",
        "frameworks",
        "parallel",
        "local_sgd",
        "tracking",
    ):
        assert word in out
