"""The fast JPEG path (simplejpeg + OpenCV) against the Pillow reference, and the fallbacks to Pillow.

Tolerance: the two paths crop the same box at the same DCT scale, but libjpeg-turbo's IDCT and
colour upsampling differ slightly from Pillow's libjpeg build, the fast path rounds the scaled box to
whole pixels, and OpenCV's bilinear resize samples 2x2 pixels where Pillow's widens its filter when
it shrinks (up to 2x after DCT scaling). Measured on these 64-pixel crops: mean absolute difference
1.3 to 2.4 (of 255), 99th percentile 5 to 8. A flipped crop, another box or swapped channels give a
mean of 15 to 51, a crop shifted by 2 pixels 8.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from training.data import decode
from training.data import imagenet as data

SIZE = 64
MAX_MEAN_DIFF = 3.0
MAX_P99_DIFF = 12.0


def photo(path: Path, mode: str = "RGB", seed: int = 0, **save: object) -> Path:
    """A smooth colour field with grain, 500x375: decodes like a photo (flat colour would hide errors)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:375, 0:500].astype(np.float32)
    channels = [
        127 + 80 * np.sin(f * x + p) * np.cos(f * y) for f, p in zip((0.03, 0.05, 0.02), (0, 2, 4), strict=True)
    ]
    pixels = np.clip(np.stack(channels, -1) + rng.normal(0, 10, (375, 500, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).convert(mode).save(path, quality=90, **save)
    return path


def assert_close(fast: np.ndarray, reference: np.ndarray) -> None:
    assert fast.shape == reference.shape == (SIZE, SIZE, 3) and fast.dtype == np.uint8
    diff = np.abs(fast.astype(int) - reference.astype(int))
    assert diff.mean() <= MAX_MEAN_DIFF and np.percentile(diff, 99) <= MAX_P99_DIFF, (
        diff.mean(),
        np.percentile(diff, 99),
    )


def pillow_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode, "FAST", None)


def test_the_fast_decoder_is_installed_and_selected() -> None:
    # requirements-train.txt pins both modules: without them every job would decode at Pillow speed.
    assert decode.FAST is not None
    assert decode.decoder_name() == "simplejpeg + OpenCV"


def test_a_missing_module_selects_pillow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for module in ("simplejpeg", "cv2"):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, module, None)  # import raises ImportError
            assert decode.import_fast() is None
    path = str(photo(tmp_path / "a.JPEG"))
    fast = data.decode_val(path, SIZE)
    pillow_only(monkeypatch)
    assert decode.decoder_name().startswith("Pillow")
    reference = data.decode_val(path, SIZE)
    assert_close(fast, reference)
    assert not np.array_equal(fast, reference)  # the two paths really differ: the patch took effect


def test_the_job_logs_which_decoder_it_uses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "train" / "n0").mkdir(parents=True)
    photo(tmp_path / "train" / "n0" / "a.JPEG")
    with caplog.at_level(logging.INFO, logger="training.data.imagenet"):
        data.load_imagenet(tmp_path, SIZE, 0)
    assert "decoding images with simplejpeg + OpenCV" in caplog.text


@pytest.mark.parametrize("seed", range(8))
def test_train_crops_match_pillow_with_the_same_random_draws(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, seed: int
) -> None:
    path = str(photo(tmp_path / "a.JPEG", seed=seed))
    fast_rng, reference_rng = np.random.default_rng(seed), np.random.default_rng(seed)
    fast = data.decode_train(path, SIZE, fast_rng)
    pillow_only(monkeypatch)
    assert_close(fast, data.decode_train(path, SIZE, reference_rng))
    # Same draws in the same order: a resumed run sees the same crops whichever decoder it has.
    assert fast_rng.bit_generator.state == reference_rng.bit_generator.state


def test_the_seeds_above_cover_both_flips_and_the_tolerance_catches_a_wrong_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flips = []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        data.random_resized_crop_box(500, 375, rng)
        flips.append(rng.random() < 0.5)
    assert set(flips) == {True, False}
    path = str(photo(tmp_path / "a.JPEG"))
    fast = data.decode_train(path, SIZE, np.random.default_rng(0))
    pillow_only(monkeypatch)
    with pytest.raises(AssertionError):
        assert_close(fast[:, ::-1], data.decode_train(path, SIZE, np.random.default_rng(0)))


@pytest.mark.parametrize("save", [{}, {"progressive": True}], ids=["baseline", "progressive"])
def test_val_center_crop_matches_pillow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, save: dict) -> None:
    path = str(photo(tmp_path / "a.JPEG", **save))
    fast = data.decode_val(path, SIZE)
    pillow_only(monkeypatch)
    assert_close(fast, data.decode_val(path, SIZE))


def test_grayscale_jpeg_decodes_to_equal_rgb_channels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = str(photo(tmp_path / "gray.JPEG", mode="L"))
    fast = data.decode_train(path, SIZE, np.random.default_rng(1))
    assert np.array_equal(fast[..., 0], fast[..., 1]) and np.array_equal(fast[..., 0], fast[..., 2])
    pillow_only(monkeypatch)
    assert_close(fast, data.decode_train(path, SIZE, np.random.default_rng(1)))


@pytest.mark.parametrize(("name", "mode"), [("cmyk.JPEG", "CMYK"), ("image.png", "RGB")])
def test_cmyk_jpeg_and_png_take_the_pillow_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, mode: str
) -> None:
    path = str(photo(tmp_path / name, mode=mode))
    fast = data.decode_train(path, SIZE, np.random.default_rng(2)), data.decode_val(path, SIZE)
    pillow_only(monkeypatch)
    reference = data.decode_train(path, SIZE, np.random.default_rng(2)), data.decode_val(path, SIZE)
    for a, b in zip(fast, reference, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_truncated_jpeg_raises_pillows_error_after_one_box_choice(tmp_path: Path) -> None:
    whole = photo(tmp_path / "a.JPEG").read_bytes()
    (tmp_path / "cut.JPEG").write_bytes(whole[: len(whole) // 2])
    chosen = []

    def choose(width: int, height: int) -> decode.Box:
        chosen.append((width, height))
        return 0, 0, width, height

    # The fast path refuses it (strict mode), Pillow gets the same box and raises what the loader skips.
    with pytest.raises(OSError, match="truncated"):
        decode.decode_region(str(tmp_path / "cut.JPEG"), SIZE, choose)
    assert chosen == [(500, 375)]


@pytest.mark.parametrize("box", [(0, 0, 500, 375), (10, 20, 300, 200), (0, 0, 120, 90), (5, 5, 60, 40), (1, 1, 20, 20)])
def test_dct_scale_is_the_one_pillow_draft_picks(tmp_path: Path, box: decode.Box) -> None:
    path = photo(tmp_path / "a.JPEG")
    with Image.open(path) as img:
        img.draft("RGB", (math.ceil(500 * SIZE / box[2]), math.ceil(375 * SIZE / box[3])))
        pillow_scale = 500 // img.size[0]
    assert decode.dct_scale(500, 375, box, SIZE) == pillow_scale
