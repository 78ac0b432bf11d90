"""The input-pipeline baseline: torchvision's ``ImageFolder`` + standard ImageNet train transforms.

torchvision 0.28 (the release paired with torch 2.13) does not import beside the CPU torch
build ("operator torchvision::nms does not exist"), so this module reproduces, line for line,
what these torchvision calls do with PIL images:

    ImageFolder(root, transform=Compose([RandomResizedCrop(size), RandomHorizontalFlip(),
                                         ToTensor(), Normalize(IMAGENET_MEAN, IMAGENET_STD)]))
    DataLoader(dataset, batch_size, shuffle=True, num_workers=workers)

Sources followed: ``torchvision.datasets.folder`` (``pil_loader``, ``make_dataset``),
``torchvision.transforms.transforms`` (``RandomResizedCrop.get_params``) and
``torchvision.transforms.functional`` / ``_functional_pil`` (``resized_crop``, ``to_tensor``,
``normalize``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def pil_loader(path: str) -> Image.Image:
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def rrc_params(img: Image.Image, scale: tuple[float, float], ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params``: (top, left, height, width), torch's RNG as upstream."""
    width, height = img.size
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return int(i), int(j), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainTransform:
    """RandomResizedCrop(size) -> RandomHorizontalFlip() -> ToTensor() -> Normalize(mean, std)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
        self.std = torch.tensor(IMAGENET_STD)[:, None, None]

    def __call__(self, img: Image.Image) -> torch.Tensor:
        top, left, h, w = rrc_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        # to_tensor: HWC uint8 -> CHW float in [0, 1]
        tensor = torch.from_numpy(np.array(img, np.uint8, copy=True))
        tensor = tensor.view(img.size[1], img.size[0], 3).permute((2, 0, 1)).contiguous()
        tensor = tensor.to(dtype=torch.get_default_dtype()).div(255)
        # normalize (not in place: upstream clones first)
        return tensor.clone().sub_(self.mean).div_(self.std)


class ImageFolder(torch.utils.data.Dataset):
    """``torchvision.datasets.ImageFolder``: sorted class folders, sorted files, ``pil_loader``."""

    def __init__(self, root: Path, size: int) -> None:
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        self.samples = [
            (str(Path(dirpath) / name), index)
            for index, cls in enumerate(classes)
            for dirpath, _, files in sorted(os.walk(root / cls, followlinks=True))
            for name in sorted(files)
            if name.lower().endswith(IMG_EXTENSIONS)
        ]
        self.transform = TrainTransform(size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        return self.transform(pil_loader(path)), target


def loader(root: Path, size: int, batch_size: int, workers: int) -> torch.utils.data.DataLoader:
    dataset = ImageFolder(root, size)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
