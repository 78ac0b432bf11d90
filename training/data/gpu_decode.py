"""JPEG decode on the GPU for the PyTorch job (``--decode gpu|auto``): nvJPEG through torchvision.

With a device decoder the DataLoader workers read each file and draw its crop box and flip
(``ImageFolder.encoded``, the draws the CPU path makes for the same key) for the share of the
images that the GPU decodes (:class:`GpuDecode`: all of them under ``--decode gpu``, the share that
``--decode auto`` measured otherwise), and decode the rest themselves, as the CPU path does. A
worker hands over one :class:`EncodedBatch`: the files, and the images it decoded stacked in one
array (pinned by the DataLoader, uploaded in one copy). The batch thread of
training/data/side_stream.py decodes the batch's JPEGs in one ``torchvision.io.decode_jpeg`` call on
its side stream, then crops, resizes and flips each image there. Files nvJPEG is not given (PNG,
CMYK) are decoded by the workers, and a file nvJPEG fails on is decoded by the CPU path on that
thread, so a batch holds exactly the images and labels the CPU path would have produced.

torchvision is pinned in the PyTorch image only: its PyPI wheel is built against the CUDA build of
torch and does not import beside the CPU build the tests run with. So the tests here drive the
selection with the real (failing) import, and the batch assembly with a stand-in decoder.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from training.data.decode import Box
from training.data.imagenet import EncodedCrop, ImageFolder, Key, Sample
from training.data.side_stream import Staged
from training.errors import BadInput

log = logging.getLogger(__name__)

# JPEG files (uint8 1-D CPU tensors) -> their full images on ``device``, uint8 CHW RGB.
JpegDecoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
NVJPEG = "nvJPEG (torchvision.io.decode_jpeg)"


def load_nvjpeg() -> JpegDecoder:
    """torchvision's batched ``decode_jpeg``; raises ImportError or RuntimeError where it cannot load."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)

    return decode


def choose_decoder(
    requested: str, device: torch.device, load: Callable[[], JpegDecoder] = load_nvjpeg
) -> JpegDecoder | None:
    """The device decoder ``--decode`` asks for, or None for the CPU path.

    ``cpu``: None. ``gpu``: nvJPEG, after it decodes a probe image on ``device``; without a CUDA
    device or a working nvJPEG the job stops with an error that says why. ``auto``: nvJPEG where
    ``gpu`` would get it, else the CPU path, with a warning when a GPU is there but nvJPEG is not.
    """
    if requested == "cpu":
        return None
    if device.type != "cuda":
        if requested == "gpu":
            raise BadInput("--decode gpu needs a CUDA device and this process has none: use --decode cpu or auto")
        return None
    try:
        decoder = load()
        decoder([probe_jpeg()], device)
    except (ImportError, OSError, RuntimeError) as exc:
        reason = f"nvJPEG is not usable here ({type(exc).__name__}: {exc})"
        if requested == "gpu":
            raise BadInput(f"--decode gpu: {reason}; the PyTorch image pins torchvision, or use --decode cpu") from None
        log.warning("decoding on the CPU: %s", reason)
        return None
    log.info("decoding JPEGs with %s on %s; other files in the workers", NVJPEG, device)
    return decoder


def probe_jpeg() -> torch.Tensor:
    """A small valid JPEG, to find out at start whether the decoder works on this device."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 120, 40)).save(buffer, format="JPEG")
    return file_tensor(buffer.getvalue())


def file_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a writable copy: torch warns on bytes


def crop_resize(image: torch.Tensor, box: Box, size: int) -> torch.Tensor:
    """``box`` of a uint8 CHW image resized to size x size, as float HWC, not yet rounded (the batch is
    rounded in a few kernels, not a few per image). Bilinear with antialiasing, the filter of
    Pillow, the reference path."""
    left, top, width, height = box
    x0, y0 = round(left), round(top)
    x1, y1 = max(round(left + width), x0 + 1), max(round(top + height), y0 + 1)
    crop = image[None, :, y0:y1, x0:x1].float()
    resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return resized[0].permute(1, 2, 0)


def gpu_decodes(key: Key, share: float) -> bool:
    """Whether the GPU decodes ``key``'s image when it takes ``share`` of them: a fixed, even spread
    over the images (Fibonacci hashing of the index), the same in every epoch and every worker."""
    index, _epoch = key
    return share >= 1.0 or (index * 0.6180339887498949) % 1.0 < share


@dataclass(frozen=True)
class GpuDecode:
    """The device decoder and the share of the images it decodes (the workers decode the others)."""

    decode: JpegDecoder
    share: float = 1.0

    def __str__(self) -> str:
        return NVJPEG if self.share >= 1.0 else f"{NVJPEG} for {self.share:.0%} of images, the rest on the CPU"


@dataclass
class EncodedBatch:
    """What a worker hands over under a device decoder: the JPEGs left to decode (with their slots in
    the batch) and the images it decoded itself, stacked (with theirs)."""

    crops: list[EncodedCrop]
    crop_slots: list[int]
    pixels: torch.Tensor  # uint8 NHWC
    pixel_slots: torch.Tensor  # int64
    labels: torch.Tensor  # int64
    skipped: int

    def pin_memory(self) -> EncodedBatch:
        """Called by the DataLoader's pinning thread: the uploads then run asynchronously."""
        self.pixels, self.pixel_slots = self.pixels.pin_memory(), self.pixel_slots.pin_memory()
        self.labels = self.labels.pin_memory()
        return self


def collate_encoded(samples: list[Sample]) -> EncodedBatch:
    """A worker's samples as one :class:`EncodedBatch` (the DataLoader's ``collate_fn``)."""
    crops, crop_slots, pixels, pixel_slots = [], [], [], []
    for slot, (image, _, _) in enumerate(samples):
        if isinstance(image, EncodedCrop):
            crops.append(image)
            crop_slots.append(slot)
        else:
            pixels.append(image)
            pixel_slots.append(slot)
    stacked = np.stack(pixels) if pixels else np.empty((0, 0, 0, 3), np.uint8)
    return EncodedBatch(
        crops,
        crop_slots,
        torch.from_numpy(stacked),
        torch.tensor(pixel_slots, dtype=torch.int64),
        torch.tensor([label for _, label, _ in samples], dtype=torch.int64),
        sum(count for _, _, count in samples),
    )


class EncodedFolder(torch.utils.data.Dataset):
    """What the DataLoader workers serve under a device decoder: files and their draws for the GPU's
    ``share`` of the images, pixels for the rest."""

    def __init__(self, folder: ImageFolder, share: float = 1.0) -> None:
        self.folder = folder
        self.share = share

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: Key) -> Sample:
        return self.folder.encoded(key) if gpu_decodes(key, self.share) else self.folder[key]


class DeviceBatcher:
    """Assembles a worker's :class:`EncodedBatch` into the batch the CPU path yields, decoding the
    JPEGs on ``device``.

    Call it only through ``training.data.side_stream.SideStreamBatches``: nvJPEG writes its output when
    called, not in stream order, so the stream it runs on must have nothing queued (see there)."""

    def __init__(self, decode: JpegDecoder, folder: ImageFolder, device: torch.device) -> None:
        self.decode = decode
        self.folder = folder
        self.device = device

    def __call__(self, batch: EncodedBatch) -> Staged:
        """The batch's device work, queued on the current stream; ``SideStreamBatches`` makes that a
        side stream and holds the returned inputs (the files nvJPEG reads, the pinned uploads) until
        the work is done."""
        size = self.folder.image_size
        labels, skipped = batch.labels, batch.skipped
        files = [file_tensor(crop.data) for crop in batch.crops]
        inputs: list[torch.Tensor] = [*files, batch.pixels, batch.pixel_slots]
        # The decode first: nvJPEG writes when called, so no work of this batch that frees a block
        # (the temporaries below) may be queued before it.
        decoded = self._decode(batch.crops, files)
        resized = torch.empty((len(labels), size, size, 3), dtype=torch.float32, device=self.device)
        fallback: dict[int, np.ndarray] = {}  # slot -> the CPU path's image, where nvJPEG failed
        for slot, crop, full in zip(batch.crop_slots, batch.crops, decoded, strict=True):
            if full is None:  # nvJPEG failed on this file: the CPU path decodes it, or skips it as it always does
                pixels, label, extra = self.folder[crop.key]
                fallback[slot] = pixels
                if label != int(labels[slot]):
                    labels = labels.clone()  # the pinned original may still be read by an earlier copy
                    labels[slot] = label
                skipped += extra
                continue
            image = crop_resize(full, crop.box, size)
            resized[slot] = image.flip(1) if crop.flip else image  # mirrored along the width
        images = resized.round_().clamp_(0, 255).to(torch.uint8)
        if len(batch.pixel_slots):  # the images the workers decoded, in one copy and one scatter
            uploaded = self._upload(batch.pixels, inputs)
            images.index_copy_(0, self._upload(batch.pixel_slots, inputs), uploaded)
        for slot, pixels in fallback.items():
            images[slot] = self._upload(torch.from_numpy(pixels), inputs)
        return Staged((images, self._upload(labels, inputs), skipped), inputs)

    def _upload(self, host: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        inputs.append(host)  # referenced until the copy has run
        return host.to(self.device, non_blocking=True)

    def _decode(self, crops: list[EncodedCrop], files: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every file in one call; if that fails (one bad file fails the whole call), one at a time."""
        if not crops:
            return []
        try:
            return list(self.decode(files, self.device))
        except RuntimeError:
            return [self._decode_one(crop, file) for crop, file in zip(crops, files, strict=True)]

    def _decode_one(self, crop: EncodedCrop, file: torch.Tensor) -> torch.Tensor | None:
        if self.device.type == "cuda":  # nothing the failed call queued may be running when this one writes
            torch.cuda.current_stream(self.device).synchronize()
        try:
            return self.decode([file], self.device)[0]
        except RuntimeError as exc:
            log.warning("nvJPEG could not decode %s (%s): decoding it on the CPU", self.folder.paths[crop.key[0]], exc)
            return None
