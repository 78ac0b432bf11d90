"""bench.cpu.decode_speed: every decoder gets a figure, the GPU path's included where it can run.

The nvJPEG row runs only on a CUDA machine with torchvision, so here it runs with the Pillow
stand-in for nvJPEG (tests/training/test_gpu_decode.py) on the CPU: the same measurement code.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from bench.cpu import decode_speed
from bench.harness.jpegs import write_imagenet_tree
from tests.training.test_gpu_decode import pillow_jpeg_decoder
from training.data.gpu_decode import DeviceBatcher
from training.data.imagenet import scan_split


def test_every_decoder_and_the_gpu_path_get_a_rate(tmp_path: Path) -> None:
    paths = [str(path) for path in write_imagenet_tree(tmp_path, images=6)]
    folder = scan_split(tmp_path, "train", 64, seed=0)
    assert folder is not None
    gpu = partial(decode_speed.gpu_rates, folder, DeviceBatcher(pillow_jpeg_decoder, folder, torch.device("cpu")))
    rates, wall = decode_speed.measure(paths, 64, rounds=2, gpu=gpu)
    assert set(rates) == {*decode_speed.DECODERS, decode_speed.GPU_ROW}
    assert all(rate > 0 for rate in rates.values()) and wall is not None and wall > 0


def test_without_a_gpu_path_there_is_no_gpu_row(tmp_path: Path) -> None:
    paths = [str(path) for path in write_imagenet_tree(tmp_path, images=2)]
    assert decode_speed.gpu_path(tmp_path, 64) is None  # no CUDA here
    rates, wall = decode_speed.measure(paths, 64, rounds=1, gpu=None)
    assert set(rates) == set(decode_speed.DECODERS) and wall is None
