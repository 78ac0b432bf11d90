"""Spot evictions on the local cluster, for real: each node's metadata endpoint (Azure's Scheduled Events
JSON on 169.254.169.254 inside its namespace) announces a Preempt, the node's Spot agent signals the job's
ranks, the job saves a checkpoint and exits 75, the agent has Slurm requeue it, the "platform" switches
the node off, and the job resumes on the other node from that checkpoint. Nothing on the job's side is
mocked: a real PyTorch job under horovodrun or torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from scripts import local_metadata
from scripts.cluster import ClusterDescription
from training.checkpoint import read_checkpoint
from tests.polling import wait_for

from .conftest import local_state_dir, slurm_command
from .test_launcher import cli, run_dir, status_of

STEPS = 600
JOB_ARGS = (
    "--data", "synthetic", "--model", "simple_cnn", "--image-size", "32", "--batch-size", "8",
    "--steps", str(STEPS), "--checkpoint-every", "40", "--log-every", "20", "--warmup-epochs", "0",
)  # fmt: skip
PREEMPTED = re.compile(r"error: preempted \(SIGUSR1: a Spot eviction\) after step (\d+): saved the checkpoint")


def launch_spot(cluster_file: Path, run_id: str, *extra: str) -> str:
    base = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "1", "--spot"]
    proc = cli(*base, "--run-id", run_id, "--detach", "--", *JOB_ARGS, *extra)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def node_of(desc: ClusterDescription, job_id: str) -> str:
    def running_on() -> str | None:
        out = slurm_command(desc, "squeue", "--noheader", f"--jobs={job_id}", "--format=%T %N").stdout.split()
        return out[1] if out and out[0] == "RUNNING" and len(out) > 1 else None

    return wait_for(running_on, 60, f"job {job_id} to run", interval=0.5)


def wait_for_step(log: Path, step: int) -> None:
    wait_for(lambda: log.exists() and f"step {step}/" in log.read_text(), 120, f"step {step}", interval=0.3)


def rank_pid(run: Path) -> int:
    """The training process (not the launcher's shell around it), found through its checkpoint directory."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"python") and b"training.pytorch" in argv and str(run).encode() in b" ".join(argv):
            return int(entry.name)
    raise AssertionError(f"no training process of {run}")


def finished(desc: ClusterDescription, run_id: str) -> dict:
    return wait_for(
        lambda: (s := status_of(desc, run_id)) and s["attempt"] == 2 and s, 180, "attempt 2 to end", interval=0.5
    )


def test_an_evicted_spot_job_checkpoints_is_requeued_and_resumes_on_the_other_node(cluster, cluster_file):
    run_id = "spot-evicted"
    job_id = launch_spot(cluster_file, run_id)
    evicted = node_of(cluster, job_id)
    run = run_dir(cluster, run_id)
    wait_for_step(run / "output.log", 100)
    announced = time.time()
    local_metadata.announce_preempt(local_state_dir(cluster), evicted)

    status = finished(cluster, run_id)
    log = (run / "output.log").read_text()
    assert status["exit_code"] == 0, log[-3000:]
    saved = int(PREEMPTED.search(log).group(1))  # type: ignore[union-attr]
    checkpoint = run / "checkpoints" / f"ckpt-{saved:010d}.ckpt"
    assert read_checkpoint(checkpoint).step == saved
    assert checkpoint.stat().st_mtime - announced < local_metadata.PREEMPT_NOTICE_S
    other = next(node for node in ("node-0", "node-1") if node != evicted)
    assert f"attempt 2, on {other} (partition spot)" in log
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["resumed_from_step"] == saved, metrics

    record = json.loads((run / "run.json").read_text())
    first, second = record["attempts"]
    assert (first["exit_code"], first["preempted"], first["partition"]) == (75, True, "spot")
    assert (second["exit_code"], second["preempted"], second["partition"]) == (0, False, "spot")
    assert first["price_per_node_hour_usd"] == second["price_per_node_hour_usd"] == 0.0  # the local cluster's
    [eviction] = record["evictions"]
    assert (eviction["node"], eviction["job_id"]) == (evicted, job_id)


def test_a_frozen_rank_is_requeued_from_the_checkpoint_before_and_nothing_is_corrupted(cluster, cluster_file):
    """The rank is stopped (SIGSTOP) before the notice: it cannot save. The agent gives up waiting and
    requeues the job (which ends the frozen attempt), and it resumes from the last periodic checkpoint."""
    run_id = "spot-frozen"
    job_id = launch_spot(cluster_file, run_id, "--backend", "ddp")
    evicted = node_of(cluster, job_id)
    run = run_dir(cluster, run_id)
    wait_for_step(run / "output.log", 100)
    os.kill(rank_pid(run), signal.SIGSTOP)
    kept = sorted(p.name for p in (run / "checkpoints").glob("ckpt-*.ckpt"))
    local_metadata.announce_preempt(local_state_dir(cluster), evicted, notice_s=20)

    status = finished(cluster, run_id)
    log = (run / "output.log").read_text()
    assert status["exit_code"] == 0, log[-3000:]
    assert not PREEMPTED.search(log)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == int(kept[-1][5:15]), (kept, metrics)
    assert metrics["steps"] == STEPS
    for path in (run / "checkpoints").iterdir():  # every file whole: no temporary, none damaged
        assert read_checkpoint(path).step == int(path.name[5:15])
    record = json.loads((run / "run.json").read_text())
    assert [a["exit_code"] for a in record["attempts"]][1] == 0 and len(record["attempts"]) == 2
    assert record["evictions"][0]["node"] == evicted
