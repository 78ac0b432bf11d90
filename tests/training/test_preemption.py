"""An eviction's SIGUSR1, job side, in the real multi-process jobs (torchrun, gloo): the signal reaches one
rank only, every rank agrees on the step to stop at (the step-boundary vote), the job saves its checkpoint
there and every rank exits 75 (PREEMPTED). Horovod's path runs on the local cluster (tests/scripts/test_spot.py)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.training.jobs import TINY, kill_tree, start, torchrun, worker_pid
from training.checkpoint.files import read_checkpoint
from training.checkpoint.sharded import ShardedCheckpoints
from training.errors import ExitCode

PREEMPTED = re.compile(r"error: preempted \(SIGUSR1: a Spot eviction[^)]*\) after step (\d+): saved the checkpoint")
MODEL_PARALLEL = ("--model", "gpt-tiny", "--seq-len", "16", "--batch-size", "2", "--log-every", "1")


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("training.pytorch", ("--backend", "ddp", "--data", "synthetic", *TINY, "--checkpoint-every", "1000")),
        ("training.model_parallel", (*MODEL_PARALLEL, "--checkpoint-every", "1000")),
    ],
    ids=["ddp", "model-parallel"],
)
def test_one_signalled_rank_stops_every_rank_at_one_step_with_a_checkpoint(
    tmp_path: Path, module: str, args: tuple[str, ...]
) -> None:
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.log"
    launcher = start(torchrun(2, *args, "--steps", "100000", "--checkpoint-dir", ckpt, module=module), log)
    try:
        rank1 = worker_pid(launcher, 1, module)
        wait_for(lambda: re.search(r"step [3-9]\d*/", log.read_text()), 120, "a few steps", interval=0.2)
        os.kill(rank1, signal.SIGUSR1)  # rank 0 learns it from the vote
        launcher.wait(timeout=120)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", log.read_text())
    finally:
        if launcher.poll() is None:
            kill_tree(launcher)
    output = log.read_text()
    step = int(PREEMPTED.search(output).group(1))  # type: ignore[union-attr]
    assert str(int(ExitCode.PREEMPTED)) in codes, output[-3000:]
    if module == "training.pytorch":
        assert read_checkpoint(ckpt / f"ckpt-{step:010d}.ckpt").step == step
    else:
        assert ShardedCheckpoints(ckpt).latest() == ckpt / f"step-{step:010d}"
