"""A generated JPEG set in ImageNet's layout, shared by the input-pipeline and staging figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# ImageNet's most common size (about a third of its train images) and a typical quality.
WIDTH, HEIGHT, QUALITY = 500, 375, 90


def photo_like(rng: np.random.Generator, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """Smooth colour fields plus grain: compresses and decodes like a photo, unlike pure noise
    (which inflates files and decode time) or flat colour (which deflates both)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy = rng.uniform(0.005, 0.05, 2).tolist()
        phase = rng.uniform(0, 6.3)
        channels.append(127 + 80 * np.sin(fx * x + phase) * np.cos(fy * y))
    image = np.stack(channels, axis=-1) + rng.normal(0, 12, (height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def write_imagenet_tree(root: Path, images: int, classes: int = 4, seed: int = 0) -> list[Path]:
    """``root/train/<class>/<n>.JPEG``; reuses files already there (same seed, same bytes)."""
    paths = []
    for i in range(images):
        path = root / "train" / f"n{i % classes:08d}" / f"img_{i:05d}.JPEG"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(photo_like(np.random.default_rng((seed, i)))).save(path, quality=QUALITY)
        paths.append(path)
    return paths
