"""Helpers to launch the training jobs as real multi-process runs (horovodrun / torchrun)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from PIL import Image

from tests.polling import wait_for
from training.run.metrics import validate_metrics

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOROVODRUN = BIN / "horovodrun"
TORCHRUN = BIN / "torchrun"
# Small enough for a shared 2-core machine: tiny model, 16x16 images, one decode worker.
# Every process a job starts inherits this variable, so that a test can find the ones left behind.
LEFTOVER_MARKER = "TRAINING_TEST_JOB"
TINY = ["--model", "resnet_tiny", "--image-size", "16", "--batch-size", "4", "--log-every", "5", "--data-workers", "1"]


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


# Commands are lists of anything str() turns into an argument (paths, numbers); start() converts.
def horovodrun(np_: int, framework: str, *args: Any) -> list[Any]:
    return [
        HOROVODRUN,
        "-np",
        np_,
        "-H",
        f"localhost:{np_}",
        "--gloo",
        sys.executable,
        "-m",
        f"training.{framework}",
        *args,
    ]


def single(framework: str, *args: Any) -> list[Any]:
    """One process without a launcher (Horovod then runs with size 1)."""
    return [sys.executable, "-m", f"training.{framework}", *args]


def torchrun(nproc: int, *args: Any, module: str = "training.pytorch") -> list[Any]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", nproc, "-m", module, *args]


def start(cmd: Sequence[Any], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a launcher in its own session, output to ``log``; ``env`` adds variables."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(part) for part in cmd],
            cwd=REPO,
            env=job_env(**(env or {})),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process it started (workers outlive a killed horovodrun)."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """The launcher's exit status; fail (and kill it) if it is still running after ``timeout``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"the job was still running {timeout}s after a worker failed") from None


def run(
    cmd: Sequence[Any], log: Path, timeout: float = 240, expect_rc: int = 0, env: dict[str, str] | None = None
) -> str:
    """Run to completion and return the output; fail with its tail on an unexpected exit, or
    when any process the job started (a decode worker, a forkserver) outlives it."""
    marker = uuid.uuid4().hex
    proc = start(cmd, log, {**(env or {}), LEFTOVER_MARKER: marker})
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(
            f"{' '.join(map(str, cmd))} timed out after {timeout}s:\n{log.read_text()[-4000:]}"
        ) from None
    output = log.read_text()
    assert rc == expect_rc, f"{' '.join(map(str, cmd))} exited {rc}:\n{output[-4000:]}"
    try:
        wait_for(lambda: not leftovers(marker), 10, f"the processes of {' '.join(map(str, cmd))} to end")
    finally:
        for pid in leftovers(marker):  # a failed check leaves nothing behind for the next test either
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
    return output


def leftovers(marker: str) -> list[int]:
    """Pids of live processes that inherited the job's marker variable, whatever their parent."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if process.environ().get(LEFTOVER_MARKER) == marker:
                found.append(process.pid)
    return found


def worker_pid(launcher: subprocess.Popen, rank: int, module: str = "training.pytorch", timeout: float = 120) -> int:
    """Pid of the worker process with the given rank under ``launcher`` (horovodrun or torchrun)."""
    return wait_for(lambda: _find_worker(launcher.pid, rank, module), timeout, f"rank {rank} of {module}")


def _find_worker(launcher_pid: int, rank: int, module: str) -> int | None:
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline, env = p.cmdline(), p.environ()
            # The Python process itself, not the shell horovodrun starts it with.
            if "-m" in cmdline and module in cmdline and env.get("HOROVOD_RANK", env.get("RANK")) == str(rank):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def read_metrics(path: Path) -> dict[str, Any]:
    metrics = json.loads(path.read_text())
    validate_metrics(metrics)  # exactly the schema's keys, finite numbers
    return metrics


def make_imagenet(root: Path, classes: int, train_per_class: int, val_per_class: int, corrupt: int = 1) -> Path:
    """A tiny ImageNet-layout JPEG tree; ``corrupt`` of the train files are not images."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(count):
                height, width = rng.integers(20, 60, size=2)
                pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"n{c:08d}_{i}.JPEG", quality=90)
    for i in range(corrupt):
        (root / "train" / "n00000000" / f"n00000000_{i}.JPEG").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    return root


def check_common(metrics: dict[str, Any], framework: str, backend: str = "horovod") -> None:
    """What every 2-worker run with ``TINY`` (batch 4 per worker) must report."""
    assert metrics["framework"] == framework
    assert metrics["backend"] == backend
    assert metrics["world_size"] == 2
    assert metrics["batch_size_per_worker"] == 4
    assert metrics["global_batch_size"] == 8
    assert metrics["device"] == "cpu"
    assert math.isfinite(metrics["final_loss"]) and metrics["final_loss"] > 0
    assert metrics["images_per_sec"] > 0
    assert metrics["images_per_sec_per_worker"] == pytest.approx(metrics["images_per_sec"] / 2)
    assert metrics["resumed_from_step"] is None


def error_lines(output: str) -> list[str]:
    """The ``error:`` lines of a job's output (horovodrun prefixes them with the rank)."""
    return [line for line in output.splitlines() if line.startswith("error: ") or "<stderr>:error: " in line]


def truncate_images(root: Path) -> None:
    """Cut every JPEG under ``root`` to a third: each one fails to decode."""
    for path in root.rglob("*.JPEG"):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])


def run_in_this_process(monkeypatch: pytest.MonkeyPatch, settings: Any, start: Any, train: Any) -> int:
    """A PyTorch job's run (training.run.job's, after parsing) as rank 0 of 1 in this process: its exit status."""
    import torch

    from dtrain.local.daemons import free_port
    from training.run import job
    from training.world.distributed import FAILURE_TIMEOUTS

    for name, value in {**FAILURE_TIMEOUTS, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("TRAINING_MIN_FREE_MB", "0")
    try:
        return job._run(settings, start, train)
    finally:
        if torch.distributed.is_initialized():  # a failed run left its group: later tests must not meet it
            torch.distributed.destroy_process_group()
