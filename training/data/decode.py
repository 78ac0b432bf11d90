"""Decode a region of an image file into a square uint8 RGB array: the one decode step of the ImageNet loader.

The fast path is simplejpeg (libjpeg-turbo) plus an OpenCV bilinear resize, about 1.7 times the
images per CPU second of the Pillow path (docs/training.md, "Data"). Pillow remains the reference
and the fallback: for files libjpeg-turbo cannot take (PNG, CMYK), for files it refuses in strict
mode, and when either module is not installed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
from PIL import Image

from training.data.images import open_image

log = logging.getLogger(__name__)

Box = tuple[float, float, float, float]  # left, top, width, height, in full-resolution pixels
BoxChooser = Callable[[int, int], Box]  # (image width, height) -> the region to decode
# CMYK and YCCK are left to Pillow, which undoes Adobe's inverted CMYK; libjpeg-turbo does not.
FAST_COLORSPACES = ("YCbCr", "Gray", "RGB")
DCT_SCALES = (8, 4, 2, 1)  # Pillow draft's reductions; also the fast ones: other N/8 scales lack SIMD IDCTs


class FastModules(NamedTuple):
    simplejpeg: ModuleType
    cv2: ModuleType


def import_fast() -> FastModules | None:
    """simplejpeg and OpenCV, or None when either is missing (the Pillow path then does all decoding)."""
    try:
        import cv2
        import simplejpeg
    except ImportError:
        return None
    # One thread per resize: the loader already runs one decode per core (workers or tf.data threads).
    cv2.setNumThreads(1)
    return FastModules(simplejpeg, cv2)


FAST = import_fast()


def decoder_name() -> str:
    return "simplejpeg + OpenCV" if FAST is not None else "Pillow (simplejpeg or opencv-python-headless not installed)"


def decode_region(path: str, size: int, choose_box: BoxChooser) -> np.ndarray:
    """Read ``path`` once, pick a region from the image's size, return it resized to size x size (uint8 HWC RGB).

    ``choose_box`` is called exactly once per image whichever decoder runs, so the random draws it
    makes (train crops) are the same with and without the fast path.
    """
    data = Path(path).read_bytes()  # one read: PIL's own come in many small chunks (about 76 per image)
    fast = FAST
    dims = _fast_dims(fast, data) if fast is not None else None
    if fast is None or dims is None:
        return _pillow_region(data, size, choose_box)
    box = choose_box(*dims)
    try:
        return _fast_region(fast, data, dims, size, box)
    except ValueError:
        # libjpeg-turbo's strict mode refuses files Pillow decodes with a warning; Pillow decides,
        # and raises its usual OSError for a truly corrupt one.
        return _pillow_region(data, size, lambda width, height: box)


def jpeg_dims(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG in a colour space that decodes to RGB as is (YCbCr, gray, RGB), read
    from its header only; None for anything else (PNG, CMYK, a header that does not parse)."""
    if FAST is not None:
        return _fast_dims(FAST, data)
    try:
        with open_image(data) as img:
            return img.size if img.format == "JPEG" and img.mode in ("RGB", "L") else None
    except (OSError, SyntaxError, Image.DecompressionBombError):
        return None


def _fast_dims(fast: FastModules, data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG the fast path handles, or None (not a JPEG, CMYK, unreadable header)."""
    try:
        height, width, colorspace, _ = fast.simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (width, height) if colorspace in FAST_COLORSPACES else None


def dct_scale(width: int, height: int, box: Box, size: int) -> int:
    """Pillow's draft choice: the largest of 8, 4, 2, 1 that still leaves the box ``size`` pixels each way."""
    _, _, w, h = box
    fit = min(width // math.ceil(width * size / w), height // math.ceil(height * size / h))
    return next(scale for scale in DCT_SCALES if scale <= max(fit, 1))


def _fast_region(fast: FastModules, data: bytes, dims: tuple[int, int], size: int, box: Box) -> np.ndarray:
    width, height = dims
    scale = dct_scale(width, height, box, size)
    # The smallest libjpeg-turbo scaling (N/8) at least this big is exactly 1/scale.
    image = fast.simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=math.ceil(width / scale), min_height=math.ceil(height / scale)
    )
    sx, sy = image.shape[1] / width, image.shape[0] / height
    left, top, w, h = box
    x0, y0 = round(left * sx), round(top * sy)
    x1, y1 = max(round((left + w) * sx), x0 + 1), max(round((top + h) * sy), y0 + 1)
    # INTER_LINEAR: the DCT scaling already leaves less than 2x to shrink, and INTER_AREA costs
    # a quarter of the throughput for a smaller difference from Pillow (docs/training.md).
    return fast.cv2.resize(image[y0:y1, x0:x1], (size, size), interpolation=fast.cv2.INTER_LINEAR)


def _pillow_region(data: bytes, size: int, choose_box: BoxChooser) -> np.ndarray:
    """The reference path. JPEG ``draft`` decodes at 1/2, 1/4 or 1/8 scale directly (much faster than
    a full decode plus resize); we ask for the smallest scale at which the box still has ``size`` pixels."""
    with open_image(data) as img:
        full_w, full_h = img.size
        left, top, w, h = choose_box(full_w, full_h)
        img.draft("RGB", (math.ceil(full_w * size / w), math.ceil(full_h * size / h)))
        sx, sy = img.size[0] / full_w, img.size[1] / full_h
        rgb = img if img.mode == "RGB" else img.convert("RGB")  # most JPEGs decode to RGB already
        box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        return np.asarray(rgb.resize((size, size), Image.BILINEAR, box=box))
