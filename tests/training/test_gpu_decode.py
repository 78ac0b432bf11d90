"""``--decode``: which decoder a job gets, and the GPU path's batches against the CPU path's.

There is no GPU here, and torchvision does not import beside the CPU build of torch (see
training/data/gpu_decode.py). The selection is tested with the real, failing import and with stand-in
loaders; the batch assembly with a stand-in for nvJPEG that decodes the same files with Pillow on
the CPU, raising RuntimeError where torchvision does. Everything else (the DataLoader worker
reading files and drawing crops, the crop and resize, the fallbacks) is the code a GPU node runs.
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.training.test_decode import SIZE, assert_close, photo
from training.config.settings import parse_settings
from training.data import decode
from training.data import imagenet as data
from training.data.gpu_decode import GpuDecode, choose_decoder, gpu_decodes, load_nvjpeg
from training.errors import BadInput
from training.pytorch import image_loader

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")  # a CUDA device object needs no GPU


def pillow_jpeg_decoder(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Stands in for nvJPEG: full-resolution uint8 CHW RGB, and RuntimeError for a file it cannot decode."""
    images = []
    for file in files:
        try:
            with Image.open(io.BytesIO(file.numpy().tobytes())) as image:
                pixels = np.asarray(image.convert("RGB"))
        except OSError as exc:
            raise RuntimeError(f"stand-in decode failed: {exc}") from exc
        images.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(device))
    return images


def never_loaded() -> None:
    raise AssertionError("nvJPEG was loaded where the CPU path was asked for")


# --- selection ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("requested", "device"), [("cpu", CUDA), ("cpu", CPU), ("auto", CPU)])
def test_the_cpu_path_needs_no_torchvision(requested: str, device: torch.device) -> None:
    assert choose_decoder(requested, device, never_loaded) is None  # type: ignore[arg-type]


def test_gpu_decode_without_a_cuda_device_is_an_error() -> None:
    with pytest.raises(BadInput, match="needs a CUDA device and this process has none: use --decode cpu or auto"):
        choose_decoder("gpu", CPU, never_loaded)  # type: ignore[arg-type]


def test_auto_falls_back_to_the_cpu_where_torchvision_does_not_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The real import, made to fail as it does without torchvision (the PyTorch image has it).
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    with pytest.raises(ImportError):
        load_nvjpeg()
    with caplog.at_level(logging.WARNING, logger="training.data.gpu_decode"):
        assert choose_decoder("auto", CUDA) is None
    assert "decoding on the CPU: nvJPEG is not usable here (ModuleNotFoundError" in caplog.text
    with pytest.raises(BadInput, match=r"--decode gpu: nvJPEG is not usable here \(ModuleNotFoundError.*torchvision"):
        choose_decoder("gpu", CUDA)


def test_a_decoder_that_fails_its_probe_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    def broken(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise RuntimeError("nvjpegCreate failed")

    with caplog.at_level(logging.WARNING, logger="training.data.gpu_decode"):
        assert choose_decoder("auto", CUDA, lambda: broken) is None
    assert "nvjpegCreate failed" in caplog.text
    with pytest.raises(BadInput, match="RuntimeError: nvjpegCreate failed"):
        choose_decoder("gpu", CUDA, lambda: broken)


@pytest.mark.parametrize("requested", ["gpu", "auto"])
def test_a_working_decoder_is_chosen_after_decoding_a_real_jpeg(requested: str) -> None:
    probes: list[torch.Tensor] = []

    def recording(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        assert device == CUDA
        probes.extend(pillow_jpeg_decoder(files, CPU))
        return probes

    assert choose_decoder(requested, CUDA, lambda: recording) is recording
    assert [tuple(probe.shape) for probe in probes] == [(3, 16, 16)]


# --- the batches --------------------------------------------------------------------------------


@pytest.fixture
def folder_root(tmp_path: Path) -> Path:
    """Two classes of photos: baseline, progressive and gray JPEGs (nvJPEG's), a CMYK JPEG and a PNG
    (the workers'), and a JPEG truncated after its header (nvJPEG fails, then the CPU path skips it)."""
    for split in ("train", "val"):
        for name in ("n0", "n1"):
            (tmp_path / split / name).mkdir(parents=True)
        photo(tmp_path / split / "n0" / "a.JPEG", seed=1)
        photo(tmp_path / split / "n0" / "b.JPEG", seed=2, progressive=True)
        photo(tmp_path / split / "n0" / "c.JPEG", mode="L", seed=3)
        photo(tmp_path / split / "n1" / "d.JPEG", mode="CMYK", seed=4)
        photo(tmp_path / split / "n1" / "e.png", seed=5)
        whole = photo(tmp_path / split / "n1" / "f.JPEG", seed=6).read_bytes()
        (tmp_path / split / "n1" / "f.JPEG").write_bytes(whole[: len(whole) // 3])
    return tmp_path


def batches(
    folder: data.ImageFolder, keys: list[list[data.Key]], workers: int, decode_jpeg: object = None, share: float = 1.0
) -> list:
    settings = parse_settings("pytorch", ["--data-workers", str(workers)])
    rank0 = SimpleNamespace(rank=0, local_size=1)
    decode = None if decode_jpeg is None else GpuDecode(decode_jpeg, share)  # type: ignore[arg-type]
    loader = image_loader(folder, iter(keys), settings, rank0, CPU, decode)  # type: ignore[arg-type]
    return list(loader)


@pytest.mark.parametrize(("split", "share"), [("train", 1.0), ("val", 1.0), ("train", 0.5)])
def test_gpu_batches_hold_what_the_cpu_path_gives(
    monkeypatch: pytest.MonkeyPatch, folder_root: Path, split: str, share: float
) -> None:
    folder = data.scan_split(folder_root, split, SIZE, seed=7, classes=["n0", "n1"])
    assert folder is not None
    epochs = (data.VAL_EPOCH,) if split == "val" else (0, 1, 2)
    keys = [[(i, epoch) for i in range(start, start + 3)] for epoch in epochs for start in (0, 3)]
    decoded: list[int] = []

    def counting(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        decoded.append(len(files))
        return pillow_jpeg_decoder(files, device)

    # One real worker process reads files and draws crops (for the GPU's share); this process decodes them.
    gpu = batches(folder, keys, workers=1, decode_jpeg=counting, share=share)
    expected = []  # per batch: one call with its JPEGs, then each alone if the truncated f.JPEG was among them
    for batch in keys:
        jpegs = [index for index, epoch in batch if index in (0, 1, 2, 5) and gpu_decodes((index, epoch), share)]
        expected += ([len(jpegs)] if jpegs else []) + ([1] * len(jpegs) if 5 in jpegs else [])
    assert decoded == expected
    split = {gpu_decodes(key, share) for batch in keys for key in batch}
    assert split == ({True} if share == 1.0 else {True, False})  # at 0.5 both decoders have work
    monkeypatch.setattr(decode, "FAST", None)  # the reference: Pillow, in this process
    reference = batches(folder, keys, workers=0)
    assert len(gpu) == len(reference) == len(keys)
    for (images, labels, skipped), (ref_images, ref_labels, ref_skipped) in zip(gpu, reference, strict=True):
        assert (images.dtype, images.shape) == (torch.uint8, (3, SIZE, SIZE, 3))
        assert labels.tolist() == ref_labels.tolist() and skipped == ref_skipped
        for image, ref_image in zip(images.numpy(), ref_images.numpy(), strict=True):
            assert_close(image, ref_image)
    assert sum(skipped for _, _, skipped in gpu) == len(epochs)  # f.JPEG, once per epoch


def test_a_file_the_decoder_fails_on_costs_only_itself(monkeypatch: pytest.MonkeyPatch, folder_root: Path) -> None:
    folder = data.scan_split(folder_root, "train", SIZE, seed=7)
    assert folder is not None
    calls: list[int] = []

    def counting(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(files))
        return pillow_jpeg_decoder(files, device)

    keys = [[(0, 0), (1, 0), (5, 0)]]  # a.JPEG, b.JPEG and the truncated f.JPEG
    ((images, labels, skipped),) = batches(folder, keys, workers=0, decode_jpeg=counting)
    assert calls == [3, 1, 1, 1]  # the batch fails as a whole, then each file alone
    assert skipped == 1 and labels.tolist() == [0, 0, 0]  # f.JPEG skipped: the next file, a.JPEG (n0), instead
    assert_close(images[2].numpy(), folder[(0, 0)][0])


def test_encoded_samples_carry_the_cpu_paths_box_and_flip(monkeypatch: pytest.MonkeyPatch, folder_root: Path) -> None:
    folder = data.scan_split(folder_root, "train", SIZE, seed=7)
    assert folder is not None
    boxes: list[decode.Box] = []
    ramp = np.broadcast_to(np.arange(SIZE, dtype=np.uint8)[None, :, None], (SIZE, SIZE, 3))

    def recording_region(path: str, size: int, choose_box: decode.BoxChooser) -> np.ndarray:
        boxes.append(choose_box(500, 375))
        return ramp

    monkeypatch.setattr(data, "decode_region", recording_region)
    flips = set()
    for epoch in (*range(8), data.VAL_EPOCH):
        crop, _, _ = folder.encoded((0, epoch))
        image, _, _ = folder[(0, epoch)]
        assert isinstance(crop, data.EncodedCrop)
        assert crop.box == boxes[-1] and crop.flip == bool(image[0, 0, 0] > image[0, -1, 0])
        flips.add(crop.flip)
    assert flips == {True, False}


@pytest.mark.parametrize("name", ["d.JPEG", "e.png"])
def test_files_nvjpeg_is_not_given_are_decoded_by_the_workers(folder_root: Path, name: str) -> None:
    folder = data.scan_split(folder_root, "train", SIZE, seed=7)
    assert folder is not None
    index = [Path(path).name for path in folder.paths].index(name)
    image, label, skipped = folder.encoded((index, 0))
    assert isinstance(image, np.ndarray)
    np.testing.assert_array_equal(image, folder[(index, 0)][0])
    assert (label, skipped) == (1, 0)
