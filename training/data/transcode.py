"""Transcode an ImageNet-layout dataset once, at staging: smaller JPEGs that decode faster on every epoch.

Framework-free (Pillow and the standard library only): `python -m dtrain stage --short-side` runs it on
the operator's machine, and the decode benchmark imports it from the training environment.

The output keeps the layout and every file name (the labels come from the paths), so the loader reads a
transcoded copy exactly like the original. Resampling is Pillow's LANCZOS: on a reduction its kernel
widens with the scale factor, so it antialiases (no moire from the fine textures ImageNet is full of),
and it is the sharpest of Pillow's filters; JPEG's DCT scaling (`draft`) first brings a large image
down to no less than twice the target cheaply, which keeps LANCZOS's quality at a fraction of its cost.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from training.data.images import open_image

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")  # what the loader (training/data/imagenet.py) reads as an image
TEMP_SUFFIX = ".transcode-tmp"  # an output being written; what a killed run leaves goes with the stale files


class TranscodeError(Exception):
    """No image in the tree could be transcoded (a wrong source, most likely)."""


@dataclass
class TranscodeSummary:
    images: int = 0  # images in the output tree (transcoded now or already up to date)
    transcoded: int = 0
    skipped: int = 0  # outputs already newer than their source
    copied: int = 0  # other files, copied as they are
    failed: int = 0
    bytes_in: int = 0  # the source images
    bytes_out: int = 0  # their transcoded copies
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        return self.transcoded / self.seconds if self.seconds else 0.0


def transcode_jpeg(data: bytes, short_side: int, quality: int = 90) -> bytes:
    """Decode an image (any format Pillow reads), resize its short side to `short_side` (never up),
    and encode it as an RGB baseline JPEG without metadata."""
    with open_image(data) as img:
        width, height = img.size
        scale = min(1.0, short_side / min(width, height))
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        # EXIF orientation is deliberately not applied: the loader ignores it, so the pixels it sees stay the same
        img.draft("RGB", (size[0] * 2, size[1] * 2))  # JPEG only: DCT scaling, never below the size asked
        rgb = img.convert("RGB")
    if rgb.size != size:
        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    # baseline, no Huffman optimisation: the fastest to decode; no exif/icc passed, so none is written
    rgb.save(out, "JPEG", quality=quality, progressive=False, optimize=False)
    return out.getvalue()


def transcode_tree(
    source: Path,
    dest: Path,
    short_side: int,
    quality: int = 90,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> TranscodeSummary:
    """Mirror `source` into `dest`: every image transcoded (same name), other files copied. Resumable:
    an output newer than its source is kept, and outputs are renamed into place only when complete.
    `progress` is called with the number of files just finished. Raises TranscodeError if every image fails."""
    started = time.monotonic()
    source, dest = Path(source), Path(dest)
    names = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file() and not p.is_symlink())
    summary = TranscodeSummary()
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        jobs = [pool.submit(_one, source / name, dest / name, short_side, quality) for name in names]
        for job in as_completed(jobs):
            _count(summary, job.result())
            if progress:
                progress(1)
    _remove_stale(dest, set(names))
    summary.seconds = round(time.monotonic() - started, 3)
    if summary.failed and summary.images == 0:
        raise TranscodeError(f"none of the {summary.failed} images under {source} could be read: {summary.errors[0]}")
    return summary


@dataclass
class _Outcome:
    kind: str  # transcoded, skipped, copied, failed
    bytes_in: int = 0
    bytes_out: int = 0
    error: str = ""


def _one(src: Path, out: Path, short_side: int, quality: int) -> _Outcome:
    is_image = src.suffix.lower() in IMAGE_SUFFIXES
    size_in = src.stat().st_size
    if out.exists() and out.stat().st_mtime_ns >= src.stat().st_mtime_ns:
        return _Outcome("skipped" if is_image else "copied", size_in, out.stat().st_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}{TEMP_SUFFIX}")
    try:
        if is_image:
            tmp.write_bytes(transcode_jpeg(src.read_bytes(), short_side, quality))
        else:
            shutil.copy2(src, tmp)  # the source's mtime: the output counts as up to date on a rerun
        os.replace(tmp, out)
    except (UnidentifiedImageError, OSError, ValueError) as exc:  # a truncated or corrupt image, or not an image
        tmp.unlink(missing_ok=True)
        out.unlink(missing_ok=True)  # an older copy of a source that is now unreadable is no longer true
        return _Outcome("failed", error=f"{src}: {exc}")
    return _Outcome("transcoded" if is_image else "copied", size_in, out.stat().st_size)


def _count(summary: TranscodeSummary, outcome: _Outcome) -> None:
    if outcome.kind == "failed":
        summary.failed += 1
        summary.errors.append(outcome.error)
        return
    setattr(summary, outcome.kind, getattr(summary, outcome.kind) + 1)
    if outcome.kind != "copied":
        summary.images += 1
        summary.bytes_in += outcome.bytes_in
        summary.bytes_out += outcome.bytes_out


def _remove_stale(dest: Path, wanted: set[Path]) -> None:
    """Outputs whose source is gone, and temporary files of a killed run: the upload sends the whole tree."""
    for path in dest.rglob("*"):
        if path.is_file() and path.relative_to(dest) not in wanted:
            path.unlink()
