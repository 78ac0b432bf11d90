"""``--decode gpu`` on a real GPU with real nvJPEG: the tests that would have caught the NaN losses.

Both let the host run ahead of the GPU, the condition the bug needed (a host sync every step hid it):
a few training steps with no per-step sync must give the CPU path's losses, and a decoded batch
must not change while the training stream, kept busy, allocates and fills freed memory around it.
They need a CUDA device and torchvision (the PyTorch image); elsewhere they skip, saying why.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench.harness import proc
from bench.harness.jpegs import write_imagenet_tree
from training.config.settings import parse_settings
from training.data import imagenet as data
from training.data.gpu_decode import GpuDecode, JpegDecoder, choose_decoder
from training.pytorch import image_loader

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 100_000_000  # about 60 ms of one GPU thread spinning: the host gets batches ahead
BATCH, BATCHES = 32, 8


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    write_imagenet_tree(root, BATCH * BATCHES, classes=4)
    return root


def losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"step \d+/\d+ epoch \d+ loss (\S+)", output)]


def job(jpeg_root: Path, decode: str, epochs: int = 3, log_every: int = 4) -> list[str]:
    """ResNet-50 in bf16, eager (compile is the default on CUDA), logging every ``log_every`` steps and
    otherwise never syncing."""
    args = [
        "--backend", "ddp", "--data", "imagenet", "--data-dir", jpeg_root, "--decode", decode,
        "--model", "resnet50", "--batch-size", BATCH, "--precision", "amp", "--epochs", epochs,
        "--log-every", log_every, "--data-workers", 3, "--seed", 7, "--no-compile",
    ]  # fmt: skip
    return [*proc.launcher("ddp", 1), "training.pytorch", *map(str, args)]


def finished(cmd: list[str], done: subprocess.CompletedProcess[str], log: Path) -> str:
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{log.read_text()[-3000:]}"
    return log.read_text()


def train(jpeg_root: Path, decode: str, log: Path, epochs: int = 3) -> str:
    """The job's output."""
    cmd = job(jpeg_root, decode, epochs)
    done = subprocess.run(cmd, cwd=proc.REPO_ROOT, env=proc.thread_env(1), capture_output=True, text=True, timeout=600)
    return finished(cmd, done, log)


def test_gpu_decode_trains_like_the_cpu_path_without_a_sync_per_step(jpeg_root: Path, tmp_path: Path) -> None:
    gpu = losses(train(jpeg_root, "gpu", tmp_path / "gpu.log"))
    cpu = losses(train(jpeg_root, "cpu", tmp_path / "cpu.log"))
    assert len(gpu) == len(cpu) == 3 * BATCHES // 4, (gpu, cpu)
    assert all(np.isfinite(gpu)), gpu
    # The decoders differ by about 1 of 255 per pixel, which moves the losses a little, not a lot.
    np.testing.assert_allclose(gpu, cpu, rtol=0.1)


def test_gpu_decode_never_trains_to_nan_in_ten_runs_logged_often(jpeg_root: Path, tmp_path: Path) -> None:
    """The NaN goal: 10 runs of 3 epochs with a short logging interval (the interval at which the first
    version trained to NaN), five at a time on the one GPU so that each host runs further ahead."""
    cmd = job(jpeg_root, "gpu", epochs=3, log_every=2)
    for wave in range(2):
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        runs = [subprocess.Popen(cmd, cwd=proc.REPO_ROOT, env=proc.thread_env(1), **output) for _ in range(5)]
        for n, run in enumerate(runs):
            output, _ = run.communicate(timeout=600)
            done = subprocess.CompletedProcess(cmd, run.returncode, output, "")
            logged = losses(finished(cmd, done, tmp_path / f"run{wave * 5 + n}.log"))
            assert len(logged) == 3 * BATCHES // 2 and all(np.isfinite(logged)), (wave * 5 + n, logged)


def test_auto_probes_on_the_gpu_and_trains_with_what_it_chose(jpeg_root: Path, tmp_path: Path) -> None:
    """The start-up probe on CUDA: both loaders, the model under DDP, the choice logged and used."""
    output = train(jpeg_root, "auto", tmp_path / "auto.log", epochs=1)
    choice = re.search(r"--decode auto: CPU loader \S+, GPU path \S+, model \S+ batches/s; decoding with (\S+)", output)
    assert choice is not None, output[-3000:]
    assert ("decoder': 'nvJPEG" in output) is (choice[1] == "nvJPEG"), output[-3000:]
    assert all(np.isfinite(losses(output))) and losses(output)


def busy_after(decode: JpegDecoder) -> JpegDecoder:
    """The decoder, then the current (side) stream kept busy, so this batch's crops are still queued
    when the next batch is decoded."""

    def decode_then_spin(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        images = decode(files, device)
        torch.cuda._sleep(BUSY_CYCLES)
        return images

    return decode_then_spin


def poison_freed_memory(device: torch.device) -> None:
    """Blocks of a decoded image's size and larger, allocated, filled and freed on the training stream."""
    for size in (500 * 375 * 3, 4 << 20, 64 << 20):
        torch.full((size,), 255, dtype=torch.uint8, device=device)


def loader(folder: data.ImageFolder, keys: list[list[data.Key]], decode: JpegDecoder, workers: int) -> Iterator:
    settings = parse_settings("pytorch", ["--data-workers", str(workers)])
    rank0 = SimpleNamespace(rank=0, local_size=1)
    return image_loader(folder, iter(keys), settings, rank0, torch.device("cuda"), GpuDecode(decode))  # type: ignore[arg-type]


@pytest.mark.parametrize("side_stream_busy", [False, True])
def test_no_decoded_batch_changes_while_freed_memory_is_poisoned(jpeg_root: Path, side_stream_busy: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    nvjpeg = choose_decoder("gpu", device)
    assert nvjpeg is not None
    folder = data.scan_split(jpeg_root, "train", 224, seed=0)
    assert folder is not None
    keys = [[(i, 0) for i in range(start, start + BATCH)] for start in range(0, BATCH * BATCHES, BATCH)]
    reference = []
    for batch_keys in keys:  # one batch at a time, the device idle before and after: the truth
        torch.cuda.synchronize()
        ((images, labels, _),) = list(loader(folder, [batch_keys], nvjpeg, workers=0))
        torch.cuda.synchronize()
        reference.append((images.cpu(), labels.cpu()))
    copies = []
    decode = busy_after(nvjpeg) if side_stream_busy else nvjpeg
    for images, labels, _ in loader(folder, keys, decode, workers=2):
        torch.cuda._sleep(BUSY_CYCLES)  # the training stream falls behind the host
        copies.append((images.clone(), labels.clone()))  # reads the batch once the GPU gets there
        del images, labels  # freed while those reads are still queued
        poison_freed_memory(device)
    torch.cuda.synchronize()
    assert len(copies) == len(reference)
    for n, ((images, labels), (ref_images, ref_labels)) in enumerate(zip(copies, reference, strict=True)):
        changed = (images.cpu() != ref_images).flatten(1).any(1).sum().item()
        assert changed == 0 and torch.equal(labels.cpu(), ref_labels), f"batch {n}: {changed} images changed"
