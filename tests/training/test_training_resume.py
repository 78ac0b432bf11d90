"""Failures: a killed worker ends the job fast, reruns resume, saves are never partial."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.training.jobs import TINY, horovodrun, kill_tree, read_metrics, run, start, wait_exit, worker_pid
from training.checkpoint.files import CheckpointDir, checkpoint_path, read_checkpoint
from training.pytorch import decode_state


def test_killed_worker_fails_the_job_and_a_rerun_resumes(tmp_path: Path) -> None:
    ckpt, metrics_path = tmp_path / "ckpt", tmp_path / "metrics.json"
    args = [*TINY, "--steps", 100, "--checkpoint-every", 10, "--checkpoint-dir", ckpt, "--metrics-json", metrics_path]
    proc = start(horovodrun(2, "pytorch", *args), tmp_path / "killed.log")
    try:
        victim = worker_pid(proc, rank=1)
        wait_for(lambda: CheckpointDir(ckpt).steps(), timeout=120, what="the first checkpoint")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        rc = wait_exit(proc, timeout=60)
    finally:
        kill_tree(proc)
    assert rc != 0
    assert time.monotonic() - killed_at < 60
    assert not metrics_path.exists()
    newest = CheckpointDir(ckpt).steps()[-1]
    assert 10 <= newest < 100

    output = run(horovodrun(2, "pytorch", *args), tmp_path / "rerun.log")
    metrics = read_metrics(metrics_path)
    assert metrics["resumed_from_step"] == newest
    assert metrics["steps"] == 100
    assert f"resuming from {ckpt} at step {newest}" in output

    # A damaged newest checkpoint is skipped with a warning; the previous one is used.
    final = checkpoint_path(ckpt, 100)
    final.write_bytes(final.read_bytes()[:-100])
    output = run(horovodrun(2, "pytorch", *args), tmp_path / "corrupt.log")
    assert f"checkpoint {final} is unusable" in output
    assert f"falling back to the older {checkpoint_path(ckpt, 90)}" in output
    metrics = read_metrics(metrics_path)
    assert metrics["resumed_from_step"] == 90
    assert metrics["steps"] == 100


def test_kills_during_saves_never_leave_a_partial_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "ckpt"
    # A 100k-class head makes each checkpoint ~50 MB: saving takes long enough to be caught mid-write.
    args = [*TINY, "--num-classes", 100_000, "--steps", 10_000, "--checkpoint-every", 1, "--checkpoint-dir", ckpt]
    interrupted = 0
    for attempt in range(3):
        done_before = CheckpointDir(ckpt).steps()[-1:] or [0]
        proc = start(horovodrun(2, "pytorch", *args), tmp_path / f"attempt{attempt}.log")
        try:
            writer = worker_pid(proc, rank=0)
            # Let one save of this attempt complete, so there is a newest checkpoint to protect.
            wait_for(lambda d=done_before[0]: CheckpointDir(ckpt).steps()[-1:] > [d], timeout=120, what="a save")
            # The writer's temporary files carry its pid: kill it while one is being written.
            tmp = wait_for(lambda w=writer: list(ckpt.glob(f".ckpt-*.tmp-{w}")), timeout=60, what="the next save")
            os.kill(writer, signal.SIGKILL)
            assert wait_exit(proc, timeout=60) != 0
        finally:
            kill_tree(proc)
        interrupted += tmp[0].exists()
    assert interrupted >= 1, "no kill landed in the middle of a save"

    steps = CheckpointDir(ckpt).steps()
    assert steps
    for step in steps:  # every checkpoint file is whole and loads
        checkpoint = read_checkpoint(checkpoint_path(ckpt, step))
        assert checkpoint.step == step == decode_state(checkpoint.payload)["step"]
    with caplog.at_level(logging.WARNING):
        newest = CheckpointDir(ckpt).load_latest(checkpoint.fingerprint, decode_state)
    assert newest is not None and newest.step == steps[-1]
    assert not caplog.records  # nothing to fall back from
