"""JPEG decode on the GPU for the PyTorch job (``--decode gpu|auto``): nvJPEG through torchvision.

With a device decoder the DataLoader workers only read each file and draw its crop box and flip
(``ImageFolder.encoded``, the draws the CPU path makes for the same key). The training process
decodes the batch's JPEGs in one ``torchvision.io.decode_jpeg`` call on its GPU, then crops,
resizes and flips each image there. Files nvJPEG is not given (PNG, CMYK) are decoded by the
workers as before, and a file nvJPEG fails on is decoded by the CPU path in this process, so a
batch holds exactly the images and labels the CPU path would have produced. All of it runs on the
side streams of training/side_stream.py, one batch ahead: decoding on the training stream trained
to NaN (see there).

torchvision is pinned in the PyTorch image only: its PyPI wheel is built against the CUDA build of
torch and does not import beside the CPU build the tests run with. So the tests here drive the
selection with the real (failing) import, and the batch assembly with a stand-in decoder.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

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
    rounded and flipped in a few kernels, not a few per image). Bilinear with antialiasing, the
    filter of Pillow, the reference path."""
    left, top, width, height = box
    x0, y0 = round(left), round(top)
    x1, y1 = max(round(left + width), x0 + 1), max(round(top + height), y0 + 1)
    crop = image[None, :, y0:y1, x0:x1].float()
    resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return resized[0].permute(1, 2, 0)


def to_pixels(resized: torch.Tensor, flipped: list[int]) -> torch.Tensor:
    """Float NHWC crops -> the uint8 NHWC batch of the CPU path, the ``flipped`` ones mirrored."""
    images = resized.round_().clamp_(0, 255).to(torch.uint8)
    if flipped:
        images[flipped] = images[flipped].flip(2)
    return images


class EncodedFolder(torch.utils.data.Dataset):
    """What the DataLoader workers serve under a device decoder: files and their draws, not pixels."""

    def __init__(self, folder: ImageFolder) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: Key) -> Sample:
        return self.folder.encoded(key)


class DeviceBatcher:
    """Assembles a worker's samples into the batch the CPU path yields, decoding the JPEGs on ``device``.

    Call it only through ``training.side_stream.SideStreamBatches``: nvJPEG writes its output when
    called, not in stream order, so the stream it runs on must have nothing queued (see there)."""

    def __init__(self, decode: JpegDecoder, folder: ImageFolder, device: torch.device) -> None:
        self.decode = decode
        self.folder = folder
        self.device = device

    def __call__(self, samples: list[Sample]) -> Staged:
        """The batch's device work, queued on the current stream; ``SideStreamBatches`` makes that a
        side stream and holds the returned inputs (the files nvJPEG reads) until the work is done."""
        size = self.folder.image_size
        labels = [label for _, label, _ in samples]
        skipped = sum(count for _, _, count in samples)
        encoded = [(slot, image) for slot, (image, _, _) in enumerate(samples) if isinstance(image, EncodedCrop)]
        files = [file_tensor(crop.data) for _, crop in encoded]
        inputs: list[torch.Tensor] = list(files)
        # The decode first: nvJPEG writes when called, so no work of this batch that frees a block
        # (the temporaries below) may be queued before it.
        decoded = self._decode([crop for _, crop in encoded], files)
        resized = torch.empty((len(samples), size, size, 3), dtype=torch.float32, device=self.device)
        ready: dict[int, torch.Tensor] = {}  # uint8 images decoded on the CPU, by slot
        for slot, (image, _, _) in enumerate(samples):
            if not isinstance(image, EncodedCrop):  # decoded by the worker (PNG, CMYK)
                ready[slot] = torch.from_numpy(image)
        flipped: list[int] = []
        for (slot, crop), full in zip(encoded, decoded, strict=True):
            if full is None:  # nvJPEG failed on this file: the CPU path decodes it, or skips it as it always does
                pixels, labels[slot], extra = self.folder[crop.key]
                ready[slot] = torch.from_numpy(pixels)
                skipped += extra
                continue
            resized[slot] = crop_resize(full, crop.box, size)
            if crop.flip:
                flipped.append(slot)
        images = to_pixels(resized, flipped)
        for slot, pixels in ready.items():
            images[slot] = self._upload(pixels, inputs)
        label_tensor = self._upload(torch.tensor(labels, dtype=torch.int64), inputs)
        return Staged((images, label_tensor, skipped), inputs)

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
