"""training/data/transcode.py, and where `stage --short-side` keeps its copies (no cluster needed; the CLI's
refusals of bad values are in test_cli_errors.py, the uploads in test_staging.py)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image, ImageCms

from dtrain.datasets import staging
from tests.polling import wait_for
from training.data import transcode
from training.data.transcode import TEMP_SUFFIX, TranscodeError, transcode_jpeg, transcode_tree

from .conftest import REPO


def encode(img: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def noisy(size: tuple[int, int]) -> Image.Image:
    return Image.effect_noise(size, 40).convert("RGB")


@pytest.mark.parametrize(
    ("size", "short_side", "expected"),
    [((300, 200), 100, (150, 100)), ((200, 500), 64, (64, 160)), ((640, 480), 160, (213, 160))],
)
def test_short_side_is_exact_and_the_aspect_ratio_kept(size, short_side, expected):
    out = decode(transcode_jpeg(encode(noisy(size)), short_side))
    assert (out.format, out.mode, out.size) == ("JPEG", "RGB", expected)


def test_a_smaller_image_is_never_upscaled():
    out = decode(transcode_jpeg(encode(noisy((90, 70))), 128))
    assert (out.format, out.size) == ("JPEG", (90, 70))


def test_grayscale_cmyk_and_png_inputs_become_rgb_jpegs():
    red_cmyk = Image.new("CMYK", (120, 100), (0, 255, 255, 0))
    rgba = Image.new("RGBA", (100, 120), (10, 200, 30, 128))
    inputs = {
        "grayscale": encode(Image.new("L", (100, 100), 77)),
        "cmyk": encode(red_cmyk),
        "png": encode(rgba, "PNG"),
        "palette png": encode(rgba.convert("RGB").convert("P"), "PNG"),
    }
    outs = {name: decode(transcode_jpeg(data, 64)) for name, data in inputs.items()}
    assert {(o.format, o.mode, min(o.size)) for o in outs.values()} == {("JPEG", "RGB", 64)}
    gray = outs["grayscale"].getpixel((32, 32))
    assert all(abs(v - 77) <= 3 for v in gray)
    r, g, b = outs["cmyk"].getpixel((32, 32))
    assert r > 200 and g < 60 and b < 60  # the colour survives, not inverted as raw Adobe CMYK would be
    r, g, b = outs["png"].getpixel((32, 32))
    assert abs(r - 10) <= 6 and abs(g - 200) <= 6 and abs(b - 30) <= 6


def test_output_is_baseline_without_metadata():
    exif = Image.Exif()
    exif[0x010F] = "camera maker"
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    source = encode(noisy((400, 300)), progressive=True, exif=exif, icc_profile=icc)
    assert b"\xff\xc2" in source and "exif" in decode(source).info  # the input is progressive, with metadata
    data = transcode_jpeg(source, 128, quality=90)
    img = decode(data)
    assert b"\xff\xc0" in data and b"\xff\xc2" not in data  # SOF0 (baseline), no SOF2 (progressive)
    assert not {"progressive", "progression", "exif", "icc_profile"} & set(img.info)
    assert b"\xff\xe1" not in data  # no APP1 (EXIF/XMP) segment at all


def test_quality_is_applied():
    source = encode(noisy((400, 300)), quality=95)
    assert len(transcode_jpeg(source, 256, quality=50)) < len(transcode_jpeg(source, 256, quality=95)) * 0.7


def make_tree(root: Path, count: int, size: tuple[int, int] = (160, 120)) -> list[Path]:
    images = []
    for i in range(count):
        folder = root / "train" / f"n{i % 3:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"img_{i:04d}.JPEG"
        path.write_bytes(encode(noisy(size)))
        images.append(path)
    (root / "LOC_synset_mapping.txt").write_text("n00000000 a class\n")
    return images


def test_tree_mirrors_counts_and_skips_what_is_up_to_date(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    images = make_tree(src, 9)
    finished: list[int] = []
    first = transcode_tree(src, dest, 64, workers=2, progress=finished.append)
    assert (first.images, first.transcoded, first.skipped, first.copied, first.failed) == (9, 9, 0, 1, 0)
    assert sum(finished) == 10
    assert first.bytes_in == sum(p.stat().st_size for p in images)
    assert 0 < first.bytes_out < first.bytes_in
    assert (dest / "LOC_synset_mapping.txt").read_text() == "n00000000 a class\n"
    for path in images:
        assert decode((dest / path.relative_to(src)).read_bytes()).size == (85, 64)

    again = transcode_tree(src, dest, 64)
    assert (again.transcoded, again.skipped, again.copied) == (0, 9, 1)
    assert again.bytes_out == first.bytes_out

    changed, removed = images[0], images[1]
    changed.write_bytes(encode(noisy((320, 200))))
    os.utime(changed, ns=(changed.stat().st_atime_ns, (dest / changed.relative_to(src)).stat().st_mtime_ns + 10**9))
    removed.unlink()
    third = transcode_tree(src, dest, 64)
    assert (third.transcoded, third.skipped) == (1, 7)
    assert decode((dest / changed.relative_to(src)).read_bytes()).size == (102, 64)
    assert not (dest / removed.relative_to(src)).exists()  # the copy mirrors the source


def test_an_unreadable_image_is_reported_not_fatal_unless_all_are(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, 4)
    broken = src / "train" / "n00000000" / "broken.JPEG"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    summary = transcode_tree(src, dest, 64)
    assert (summary.transcoded, summary.failed) == (4, 1)
    assert str(broken) in summary.errors[0]
    assert not (dest / broken.relative_to(src)).exists()
    assert not list(dest.rglob(f"*{TEMP_SUFFIX}"))

    only_broken = tmp_path / "only-broken" / "train" / "n0"
    only_broken.mkdir(parents=True)
    (only_broken / "a.JPEG").write_bytes(b"junk")
    with pytest.raises(TranscodeError, match="none of the 1 images"):
        transcode_tree(tmp_path / "only-broken", tmp_path / "out2", 64)


def test_tree_resumes_after_a_kill_doing_only_what_is_missing(tmp_path, monkeypatch):
    src, dest = tmp_path / "src", tmp_path / "dest"
    images = make_tree(src, 60, size=(256, 192))
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from training.data.transcode import transcode_tree
        transcode_tree(Path({str(src)!r}), Path({str(dest)!r}), 64, workers=1, progress=lambda n: time.sleep(0.05))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)

    def done() -> list[Path]:
        return [p for p in dest.rglob("*.JPEG") if not p.name.endswith(TEMP_SUFFIX)]

    try:
        wait_for(lambda: len(done()) >= 10 or proc.poll() is not None, 60, "the first outputs", interval=0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the transcode finished before it could be interrupted"
    before = {p.relative_to(dest) for p in done()}
    assert 10 <= len(before) < 60
    leftover = dest / "train" / "n00000000" / f".img_0000.JPEG{TEMP_SUFFIX}"  # what a kill mid-write leaves
    leftover.write_bytes(b"half a jpeg")

    calls: list[int] = []
    real = transcode.transcode_jpeg
    monkeypatch.setattr(transcode, "transcode_jpeg", lambda data, *a: calls.append(1) or real(data, *a))
    resumed = transcode_tree(src, dest, 64)
    assert (resumed.skipped, resumed.transcoded, resumed.failed) == (len(before), 60 - len(before), 0)
    assert len(calls) == 60 - len(before)
    assert not list(dest.rglob(f"*{TEMP_SUFFIX}"))
    for path in images:
        assert decode((dest / path.relative_to(src)).read_bytes()).size == (85, 64)  # every output complete


def test_the_transcoded_cache_is_keyed_by_source_and_setting(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = {
        staging.transcoded_cache(a, 160, 90),
        staging.transcoded_cache(a, 160, 80),
        staging.transcoded_cache(b, 160, 90),
    }
    assert len(keys) == 3 and all(k.parent == staging._cache_dir() / "transcoded" for k in keys)
