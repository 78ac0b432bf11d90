"""Train-crop decode speed in images per CPU second, one thread: the two paths of training.data.decode
against torchvision's defaults (RandomResizedCrop + RandomHorizontalFlip on a PIL decode).

``.venv-train/bin/python -m bench.cpu.decode_speed [--images 200] [--rounds 5] [--size 224]``

The decoders take turns within each round (so a neighbour's load hits all of them alike) and the
median round is reported. CPU time of this process only: every decoder runs in it. On a CUDA
machine with torchvision (the PyTorch image), ``--decode gpu``'s path takes a turn too: the
workers' part (read, header, draws) and the batched nvJPEG decode, crop and resize, per CPU second
of the host and per second of wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.cpu.tv_baseline import pil_loader, rrc_params
from bench.harness.jpegs import write_imagenet_tree
from training.data import decode
from training.data import imagenet as data
from training.data.gpu_decode import DeviceBatcher, choose_decoder, collate_encoded
from training.data.side_stream import SideStreamBatches, streams_for

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
    "training.data.decode, Pillow path": ours_pillow,
    f"training.data.decode, {decode.decoder_name()}": ours,
    "torchvision defaults": torchvision_defaults,
}


def images_per_cpu_second(decoder: Decoder, paths: list[str], size: int) -> float:
    start = time.process_time()
    for index, path in enumerate(paths):
        decoder(path, size, index)
    return len(paths) / (time.process_time() - start)


GPU_ROW = "training.data.gpu_decode, nvJPEG, batches of 64"
GPU_BATCH = 64


def gpu_rates(folder: data.ImageFolder, batcher: DeviceBatcher) -> tuple[float, float]:
    """(images per CPU second, images per wall second) of the GPU path over ``folder``'s train crops:
    the workers' part and the batch's decode, crop and resize (on side streams, as in training), run
    in this process."""
    cpu, wall = time.process_time(), time.perf_counter()
    samples = (
        collate_encoded([folder.encoded((index, 0)) for index in range(start, min(start + GPU_BATCH, len(folder)))])
        for start in range(0, len(folder), GPU_BATCH)
    )
    for _ in SideStreamBatches(batcher, streams_for(batcher.device))(samples):
        pass
    if batcher.device.type == "cuda":
        torch.cuda.synchronize(batcher.device)
    return len(folder) / (time.process_time() - cpu), len(folder) / (time.perf_counter() - wall)


def measure(
    paths: list[str], size: int, rounds: int, gpu: Callable[[], tuple[float, float]] | None
) -> tuple[dict[str, float], float | None]:
    """Median images per CPU second of each decoder, and the GPU path's median images per wall second."""
    rates: dict[str, list[float]] = defaultdict(list)
    wall: list[float] = []
    for _ in range(rounds):
        for name, decoder in DECODERS.items():
            rates[name].append(images_per_cpu_second(decoder, paths, size))
        if gpu is not None:
            cpu_rate, wall_rate = gpu()
            rates[GPU_ROW].append(cpu_rate)
            wall.append(wall_rate)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return medians, statistics.median(wall) if wall else None


def gpu_path(root: Path, size: int) -> Callable[[], tuple[float, float]] | None:
    """The GPU path's measurement over ``root``, or None without CUDA and torchvision."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda")
    decode_jpeg = choose_decoder("auto", device)
    folder = data.scan_split(root, "train", size, seed=0)
    if decode_jpeg is None or folder is None:
        return None
    return partial(gpu_rates, folder, DeviceBatcher(decode_jpeg, folder, device))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu.decode_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(p) for p in write_imagenet_tree(Path(tmp), args.images)]
        rates, gpu_wall = measure(paths, args.size, args.rounds, gpu_path(Path(tmp), args.size))
    baseline = rates["torchvision defaults"]
    for name, rate in rates.items():
        print(f"{name:45s} {rate:6.0f} images/CPU-s  {rate / baseline:4.2f}x torchvision")
    if gpu_wall is None:
        print("(no nvJPEG row: it needs a CUDA device and torchvision, as in the PyTorch image)")
    else:
        print(f"{GPU_ROW}: {gpu_wall:.0f} images/s of wall time on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
