"""Framework-neutral input: ImageNet folders (scan, shard, decode, augment) and synthetic batches.

Images leave this module as uint8 HWC arrays; each framework converts and normalizes them on
its device (a quarter of the host-to-device bytes of float32). Every random choice is seeded
from ``(seed, epoch, index)``, so the data a step sees does not depend on decode-worker
scheduling, and a resumed run sees exactly the batches the interrupted one would have.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from training.config.args import DEFAULT_SYNTHETIC_STEPS
from training.config.models import SYNTHETIC_CLASSES
from training.config.settings import TrainingSettings
from training.data.decode import Box, decode_region, decoder_name, jpeg_dims
from training.data.transcode import IMAGE_SUFFIXES
from training.errors import BadInput

log = logging.getLogger(__name__)

# ImageNet channel statistics on the 0-255 scale, applied on the device.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
VAL_RESIZE_RATIO = 0.875  # resize to size / 0.875, then center-crop size (224 from 256)
VAL_EPOCH = -1  # the "epoch" of a validation key: center crop, no randomness
# More unreadable files than this in a row is a broken data directory, not a few bad files; it
# also bounds the work a sample can cost (an all-corrupt split would otherwise try every file).
MAX_UNREADABLE_IN_A_ROW = 50

Key = tuple[int, int]  # (image index, epoch)


@dataclass(frozen=True)
class EncodedCrop:
    """A JPEG left for the training process to decode on its GPU (``--decode gpu``), with the crop
    box and flip its key draws: the draws the CPU path makes for the same key, in the same order."""

    data: bytes
    box: Box
    flip: bool
    key: Key


Sample = tuple[np.ndarray | EncodedCrop, int, int]  # (image or the file to decode, label, images skipped)


class DataDirError(BadInput):
    """The data directory is missing, empty, inconsistent or unreadable; the message names the path."""


@dataclass
class ImageFolder:
    """One split of an ImageNet-layout directory: ``<split>/<class>/<image>``."""

    root: Path
    paths: list[str]
    labels: np.ndarray
    classes: list[str]
    image_size: int
    seed: int

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: Key) -> tuple[np.ndarray, int, int]:
        """Decode one sample; return ``(uint8 HWC image, label, images skipped)``.

        An unreadable or corrupt file is skipped and counted, and the next file takes its
        place, so batches keep their size (fixed shapes, equal weight per rank in the
        allreduce).
        """
        index, epoch = key
        tries = min(len(self.paths), MAX_UNREADABLE_IN_A_ROW)
        for skipped in range(tries):
            i = (index + skipped) % len(self.paths)
            try:
                if epoch == VAL_EPOCH:
                    image = decode_val(self.paths[i], self.image_size)
                else:
                    rng = np.random.default_rng((self.seed, epoch, i))
                    image = decode_train(self.paths[i], self.image_size, rng)
                return image, int(self.labels[i]), skipped
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
                log.warning("skipping unreadable image %s: %s", self.paths[i], exc)
                reason = f"{self.paths[i]}: {exc}"
        raise DataDirError(
            f"{tries} images in a row under {self.root} could not be decoded (the last, {reason}): "
            "check the data directory (a truncated copy?)"
        )

    def encoded(self, key: Key) -> Sample:
        """``key``'s sample for a device decoder: the file's bytes with its crop and flip when it is a
        JPEG that decodes to RGB as is; anything else (PNG, CMYK, a file that does not read) is
        decoded here, exactly as ``self[key]`` does."""
        index, epoch = key
        try:
            data = Path(self.paths[index]).read_bytes()
        except OSError:
            return self[key]  # skips and counts the file, as the CPU path does
        dims = jpeg_dims(data)
        if dims is None:
            return self[key]
        if epoch == VAL_EPOCH:
            box, flip = center_crop_box(*dims), False
        else:
            rng = np.random.default_rng((self.seed, epoch, index))
            box, flip = random_resized_crop_box(*dims, rng), bool(rng.random() < 0.5)
        return EncodedCrop(data, box, flip, key), int(self.labels[index]), 0


def scan_split(
    root: Path, split: str, image_size: int, seed: int, classes: list[str] | None = None
) -> ImageFolder | None:
    """Index ``root/split``. Returns None if the split directory does not exist.

    ``classes`` (the train split's) fixes the label numbering for validation.
    """
    split_dir = root / split
    if not split_dir.is_dir():
        return None
    found = sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())
    if classes is None:
        classes = found
    else:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise DataDirError(f"{split_dir} has classes not in train/: {', '.join(unknown[:5])}")
    if not found:
        raise DataDirError(f"{split_dir} contains no class folders (expected {split}/<class>/*.JPEG)")
    label_of = {name: label for label, name in enumerate(classes)}
    paths: list[str] = []
    labels: list[int] = []
    for name in found:
        files = sorted(
            entry.path
            for entry in os.scandir(split_dir / name)
            if entry.is_file() and entry.name.lower().endswith(IMAGE_SUFFIXES)
        )
        if not files:
            # A class without images would still get a label and an output of the model.
            raise DataDirError(
                f"class folder {split_dir / name} contains no images ({', '.join(IMAGE_SUFFIXES)}): "
                "add its images or remove the folder"
            )
        paths += files
        labels += [label_of[name]] * len(files)
    return ImageFolder(split_dir, paths, np.asarray(labels, dtype=np.int32), classes, image_size, seed)


def load_imagenet(data_dir: Path, image_size: int, seed: int) -> tuple[ImageFolder, ImageFolder | None]:
    """Index ``train/`` (required) and ``val/`` (optional) under ``data_dir``."""
    if not data_dir.exists():
        raise DataDirError(f"data directory {data_dir} does not exist")
    if not data_dir.is_dir():
        raise DataDirError(f"data directory {data_dir} is a file: pass the directory that holds train/ and val/")
    train = scan_split(data_dir, "train", image_size, seed)
    if train is None:
        raise DataDirError(f"{data_dir / 'train'} does not exist (expected train/<class>/*.JPEG)")
    log.info("decoding images with %s", decoder_name())
    return train, scan_split(data_dir, "val", image_size, seed, train.classes)


def random_resized_crop_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """Inception-style crop ``(left, top, width, height)``: random area fraction and aspect."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    # Fallback: the whole image, center-cropped to the nearest allowed aspect ratio.
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def decode_train(path: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Random resized crop and horizontal flip (the standard ResNet train augmentation)."""
    image = decode_region(path, size, lambda w, h: random_resized_crop_box(w, h, rng))
    return np.ascontiguousarray(image[:, ::-1]) if rng.random() < 0.5 else image


def center_crop_box(width: int, height: int) -> Box:
    """Validation: the short side resized to size / 0.875, then the center size x size."""
    side = min(width, height) * VAL_RESIZE_RATIO
    return (width - side) / 2, (height - side) / 2, side, side


def decode_val(path: str, size: int) -> np.ndarray:
    return decode_region(path, size, center_crop_box)


def steps_per_epoch(train_images: int, world_size: int, batch_size: int) -> int:
    """Steps in one pass over a rank's shard (every rank gets the same count)."""
    full = train_images // world_size // batch_size
    if full == 0:
        raise DataDirError(
            f"{train_images} training images are fewer than one batch per rank "
            f"({world_size} ranks x batch {batch_size})"
        )
    return full


def train_keys(
    num_images: int,
    rank: int,
    world_size: int,
    batch_size: int,
    seed: int,
    steps_per_epoch: int,
    start_step: int,
    total_steps: int,
) -> Iterator[list[Key]]:
    """Per-step batches of keys for one rank, from ``start_step`` to ``total_steps``.

    Each epoch is a fresh permutation (same on every rank) cut into equal shards, so ranks
    never see the same image in an epoch and all take the same number of steps (unequal
    counts would leave one rank waiting in an allreduce).
    """
    per_rank = num_images // world_size
    for step in range(start_step, total_steps):
        epoch, batch = divmod(step, steps_per_epoch)
        if step == start_step or batch == 0:
            order = np.random.default_rng((seed, epoch)).permutation(num_images)
            shard = order[rank * per_rank : (rank + 1) * per_rank]
        yield [(int(i), epoch) for i in shard[batch * batch_size : (batch + 1) * batch_size]]


def val_keys(num_images: int, rank: int, world_size: int, batch_size: int) -> Iterator[list[Key]]:
    """This rank's validation batches: every image exactly once over all ranks."""
    mine = range(rank, num_images, world_size)
    for start in range(0, len(mine), batch_size):
        yield [(i, VAL_EPOCH) for i in mine[start : start + batch_size]]


def synthetic_batch(
    seed: int, rank: int, batch_size: int, image_size: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's slice of a fixed random global batch (uint8 NHWC images, int64 labels).

    Sample ``i`` of the global batch depends only on ``(seed, i)``, so N ranks x batch B see
    exactly the samples one rank x batch N*B sees.
    """
    images = np.empty((batch_size, image_size, image_size, 3), dtype=np.uint8)
    labels = np.empty(batch_size, dtype=np.int64)
    for j in range(batch_size):
        rng = np.random.default_rng((seed, rank * batch_size + j))
        images[j] = rng.integers(0, 256, images.shape[1:], dtype=np.uint8)
        labels[j] = rng.integers(0, num_classes)
    return images, labels


class SkipCounter:
    """Unreadable images met by this process (thread-safe: tf.data decodes in threads)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


@dataclass
class DataPlan:
    """What a job needs to know about its data before building framework loaders."""

    train: ImageFolder | None  # None: synthetic
    val: ImageFolder | None
    num_classes: int
    steps_per_epoch: int
    total_steps: int  # --steps, else --epochs x steps_per_epoch; the last epoch may be partial


def plan_data(settings: TrainingSettings, world_size: int) -> DataPlan:
    """Index ImageNet (or not, for synthetic data) and fix classes, the epoch and the run's length."""
    if settings.data == "synthetic":
        per_epoch, total = sampled_epochs(settings.steps, settings.epochs)
        return DataPlan(None, None, settings.num_classes or SYNTHETIC_CLASSES, per_epoch, total)
    train, val = load_imagenet(settings.data_dir, settings.image_size, settings.seed)
    num_classes = len(train.classes)
    if num_classes < 2:
        raise DataDirError(
            f"{train.root} has one class ({train.classes[0]}): a classifier needs at least two class folders"
        )
    if settings.num_classes is not None:
        if settings.num_classes < num_classes:
            raise DataDirError(
                f"{train.root} has {num_classes} classes, more than --num-classes {settings.num_classes}"
            )
        num_classes = settings.num_classes
    per_epoch = steps_per_epoch(len(train), world_size, settings.batch_size)
    return DataPlan(train, val, num_classes, per_epoch, settings.steps or settings.epochs * per_epoch)


def sampled_epochs(steps: int | None, epochs: int) -> tuple[int, int]:
    """(steps per epoch, the run's steps) of data made or sampled per step (synthetic images or tokens, text
    windows): there is no data to pass over, so an "epoch" (LR schedule, checkpoints) is --steps, or a
    fixed count."""
    per_epoch = steps or DEFAULT_SYNTHETIC_STEPS
    return per_epoch, steps or epochs * per_epoch


def default_workers(local_size: int) -> int:
    """Decode workers per process: the node's CPUs split among its processes, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // max(local_size, 1) - 1))
