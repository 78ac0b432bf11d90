"""Train-crop decode speed in images per CPU second, one thread: the two paths of training.decode
against torchvision's defaults (RandomResizedCrop + RandomHorizontalFlip on a PIL decode).

``.venv-train/bin/python -m bench.decode_speed [--images 200] [--rounds 5] [--size 224]``

The three decoders take turns within each round (so a neighbour's load hits all of them alike)
and the median round is reported. CPU time of this process only: every decoder runs in it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.jpegs import write_imagenet_tree
from bench.tv_baseline import pil_loader, rrc_params
from training import data, decode

Decoder = Callable[[str, int, int], np.ndarray]  # (path, size, image index) -> uint8 HWC crop


@contextlib.contextmanager
def pillow_only() -> Iterator[None]:
    fast, decode.FAST = decode.FAST, None
    try:
        yield
    finally:
        decode.FAST = fast


def ours(path: str, size: int, index: int) -> np.ndarray:
    return data.decode_train(path, size, np.random.default_rng((0, index)))


def ours_pillow(path: str, size: int, index: int) -> np.ndarray:
    with pillow_only():
        return ours(path, size, index)


def torchvision_defaults(path: str, size: int, index: int) -> np.ndarray:
    img = pil_loader(path)
    top, left, h, w = rrc_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
    img = img.crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)
    if torch.rand(1) < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(img)


DECODERS: dict[str, Decoder] = {
    "training.decode, Pillow path": ours_pillow,
    f"training.decode, {decode.decoder_name()}": ours,
    "torchvision defaults": torchvision_defaults,
}


def images_per_cpu_second(decoder: Decoder, paths: list[str], size: int) -> float:
    start = time.process_time()
    for index, path in enumerate(paths):
        decoder(path, size, index)
    return len(paths) / (time.process_time() - start)


def measure(paths: list[str], size: int, rounds: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {name: [] for name in DECODERS}
    for _ in range(rounds):
        for name, decoder in DECODERS.items():
            rates[name].append(images_per_cpu_second(decoder, paths, size))
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(p) for p in write_imagenet_tree(Path(tmp), args.images)]
        rates = measure(paths, args.size, args.rounds)
    baseline = rates["torchvision defaults"]
    for name, rate in rates.items():
        print(f"{name:45s} {rate:6.0f} images/CPU-s  {rate / baseline:4.2f}x torchvision")


if __name__ == "__main__":
    main()
