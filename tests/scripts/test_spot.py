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

import pytest

from dtrain.cluster.description import ClusterDescription
from dtrain.local import metadata as local_metadata
from dtrain.local import slurm_conf
from dtrain.local.nodes import spot_agent_role
from dtrain.local.state import load_state
from dtrain.processes import descendants, stop_pids
from tests.polling import wait_for
from training.checkpoint.files import read_checkpoint

from .conftest import local_state_dir, own_cluster, slurm_command
from .test_kept_checkpoints import keep_own_checkpoint, resume_own_checkpoint
from .test_launcher import cli, run_dir, status_of

STEPS = 300
# About 20 steps/s on an idle 2-core machine: an eviction announced at step 60 lands well before the end
# (at 32 px and batch 8 the job ran its 300 steps before the agent's next poll).
JOB_ARGS = (
    "--data", "synthetic", "--model", "simple_cnn", "--image-size", "96", "--batch-size", "128",
    "--steps", str(STEPS), "--checkpoint-every", "20", "--log-every", "20", "--warmup-epochs", "0",
    "--keep-checkpoints", "100",
)  # fmt: skip
PREEMPTED = re.compile(r"error: preempted \(SIGUSR1: a Spot eviction[^)]*\) after step (\d+): saved the checkpoint")


def launch_spot(cluster_file: Path, run_id: str, *extra: str) -> str:
    base = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "1", "--spot"]
    proc = cli(*base, "--run-id", run_id, "--detach", "--", *JOB_ARGS, *extra)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def node_of(desc: ClusterDescription, job_id: str, not_on: str | None = None) -> str:
    """The node the job runs on; with not_on, once it runs elsewhere (the evicted attempt's batch script
    may still be recording and uploading on the old node)."""

    def running_on() -> str | None:
        out = slurm_command(desc, "squeue", "--noheader", f"--jobs={job_id}", "--format=%T %N").stdout.split()
        node = out[1] if out and out[0] == "RUNNING" and len(out) > 1 else None
        return node if node != not_on else None

    where = f" on another node than {not_on}" if not_on else ""
    return wait_for(running_on, 60, f"job {job_id} to run{where}", interval=0.5)


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


def agents_said(desc: ClusterDescription) -> str:
    """The Spot agents' logs: what happened, when an attempt did not end as it should."""
    logs = sorted((local_state_dir(desc) / "logs").glob("spot-agent-*.log"))
    return "\n".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in logs)


def attempt_recorded(desc: ClusterDescription, run_id: str, attempt: int) -> dict:
    """That attempt's entry in run.json, once its batch script has recorded it. (Not status.json, which the
    next attempt removes as it starts: a requeued attempt may start within a poll of the last one's end.)"""

    def entry() -> dict | None:
        path = run_dir(desc, run_id) / "run.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        return next((a for a in record.get("attempts", []) if a["attempt"] == attempt), None)

    try:
        return wait_for(entry, 120, f"attempt {attempt} in run.json", 0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents_said(desc)}") from None


# An attempt's end: a frozen rank is killed only KillWait after the requeue's TERM, then the next attempt
# starts, resumes, trains the rest and closes its run; the rest is a margin for a loaded machine (150 s
# was short once at load 20 on 2 cores).
ATTEMPT_END_S = slurm_conf.KILL_WAIT_S + 300


def run_ended(desc: ClusterDescription, run_id: str, attempt: int) -> dict:
    """The run's status once its last attempt has ended and uploaded its results."""
    try:
        return wait_for(
            lambda: (s := status_of(desc, run_id)) and s["attempt"] == attempt and s,
            ATTEMPT_END_S,
            f"attempt {attempt}",
            0.5,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents_said(desc)}") from None


def test_evicted_spot_jobs_checkpoint_are_requeued_and_resume_and_a_frozen_one_from_the_checkpoint_before(
    cluster, cluster_file
):
    """One run, three attempts (a job's start-up is most of the time): attempt 1 is evicted, saves a
    checkpoint within the notice and resumes on the other node; there its rank is frozen (SIGSTOP) before
    the next notice, so it cannot save: the agent gives up waiting and requeues it (which ends the frozen
    attempt), and attempt 3 resumes from the newest whole checkpoint, with every checkpoint file whole."""
    run_id = "spot-evicted"
    job_id = launch_spot(cluster_file, run_id)
    first = node_of(cluster, job_id)
    run, state_dir = run_dir(cluster, run_id), local_state_dir(cluster)
    wait_for_step(run / "output.log", 60)
    announced = time.time()
    local_metadata.announce_preempt(state_dir, first)

    # attempt 1: saved at the notice, requeued, resumed on the other node
    assert attempt_recorded(cluster, run_id, 1)["exit_code"] == 75
    log = (run / "output.log").read_text()
    saved = int(PREEMPTED.search(log).group(1))  # type: ignore[union-attr]
    checkpoint = run / "checkpoints" / f"ckpt-{saved:010d}.ckpt"
    assert read_checkpoint(checkpoint).step == saved
    assert checkpoint.stat().st_mtime - announced < local_metadata.PREEMPT_NOTICE_S
    second = node_of(cluster, job_id, not_on=first)
    wait_for(lambda: f"resuming from {run / 'checkpoints'} at step {saved}" in (run / "output.log").read_text(), 60,
             "attempt 2 to resume")  # fmt: skip

    # attempt 2: frozen, cannot save by the deadline; the requeue ends it and attempt 3 resumes from the newest
    # whole checkpoint (Slurm continues the stopped rank as it ends the attempt: it may save once more then)
    wait_for_step(run / "output.log", (saved // 20 + 2) * 20)  # a logged step, a checkpoint or more after
    os.kill(rank_pid(run), signal.SIGSTOP)
    frozen_at = max(int(p.name[5:15]) for p in (run / "checkpoints").glob("ckpt-*.ckpt"))
    local_metadata.announce_preempt(state_dir, second, notice_s=20)
    status = run_ended(cluster, run_id, 3)
    log = (run / "output.log").read_text()
    assert status["exit_code"] == 0, log[-3000:]
    assert "CANCELLED AT" in log and "DUE TO JOB REQUEUE" in log  # the agent stopped waiting for it
    resumed = int(re.findall(r"resuming from \S+ at step (\d+)", log)[-1])
    assert resumed >= frozen_at
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["resumed_from_step"] == resumed, metrics
    for path in (run / "checkpoints").iterdir():  # every file whole: no temporary, none damaged
        assert read_checkpoint(path).step == int(path.name[5:15])

    record = json.loads((run / "run.json").read_text())
    assert [(a["exit_code"], a["preempted"], a["partition"]) for a in record["attempts"]] == [
        (75, True, "spot"),
        (record["attempts"][1]["exit_code"], False, "spot"),
        (0, False, "spot"),
    ]
    assert record["attempts"][1]["exit_code"] != 0
    assert {a["price_per_node_hour_usd"] for a in record["attempts"]} == {0.0}  # the local cluster's price
    assert [(e["node"], e["job_id"]) for e in record["evictions"]] == [(first, job_id), (second, job_id)]


def stop_spot_agent(desc: ClusterDescription, node: str) -> None:
    """The node's agent gone (crashed, or too slow to see the notice): nothing on the node reacts."""
    state = load_state(local_state_dir(desc))
    assert state is not None
    record = state.record(spot_agent_role(node))
    assert record is not None and record.alive()
    stop_pids([record.pid, *descendants(record.pid)], signals=(signal.SIGKILL,))


def node_states(desc: ClusterDescription) -> dict[str, str]:
    text = slurm_command(desc, "sinfo", "--noheader", "--Node", "--format=%N %T").stdout
    return dict(line.split() for line in text.splitlines())


@pytest.mark.parametrize("agent", ["running, 1 s notice", "stopped"])
def test_a_node_evicted_before_its_agent_could_act_comes_back_and_the_two_node_job_finishes(
    cluster, cluster_file, agent
):
    """The batch host of a 2-node Spot job is evicted with a 1-second notice (its agent drains the node and
    has no time for the rest), or with its agent stopped (nothing on the node sees the notice). Slurm
    loses the node and requeues the job, which needs both nodes again: the head node's reconcile finds
    the node switched off and powers it down through Slurm, which starts it again for the job. The
    job finishes, both nodes are back, and run.json has the lost attempt."""
    run_id = f"spot-missed-{agent.split(',')[0]}"
    base = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2", "--spot"]
    proc = cli(*base, "--run-id", run_id, "--detach", "--", *with_steps(60))
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    node_of(cluster, job_id)
    batch_host = slurm_command(cluster, "squeue", "--noheader", f"--jobs={job_id}", "--format=%B").stdout.strip()
    run = run_dir(cluster, run_id)
    wait_for_step(run / "output.log", 20)
    if agent == "stopped":
        stop_spot_agent(cluster, batch_host)
    local_metadata.announce_preempt(local_state_dir(cluster), batch_host, notice_s=1)

    try:
        status = wait_for(lambda: (s := status_of(cluster, run_id)) and s["exit_code"] == 0 and s, 420,
                          "the requeued job to finish", 1)  # fmt: skip
    except AssertionError as exc:
        logs = local_state_dir(cluster) / "logs"
        said = (logs / "reconcile.log").read_text()[-2000:] if (logs / "reconcile.log").exists() else "no log"
        raise AssertionError(f"{exc}\n{node_states(cluster)}\nreconcile:\n{said}\n{agents_said(cluster)}") from None
    assert status["attempt"] >= 2
    record = json.loads((run / "run.json").read_text())
    first, *_, last = record["attempts"]
    assert first["attempt"] == 1 and first["exit_code"] != 0, record
    assert last["exit_code"] == 0 and len(record["attempts"]) == status["attempt"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 60 and metrics["resumed_from_step"] >= 20, metrics
    back = wait_for(lambda: (states := node_states(cluster)) and all(
        state.rstrip("~") in ("idle", "mixed", "allocated") for state in states.values()) and states, 120,
        "both nodes back", 1)  # fmt: skip
    assert set(back) == {"node-0", "node-1"}


def test_a_run_resumes_on_a_fresh_cluster_from_the_checkpoint_it_kept_in_blob_storage(tmp_path):
    """Every attempt keeps its newest checkpoint in the results container; the storage outlives the cluster
    (`local up --storage-dir`, as Azure's storage outlives `pulumi destroy`), and a run on a new cluster
    starts from it (`launch --resume-from`): ours, and your own code's ($CHECKPOINT_DIR, mirrored while it
    runs; the new cluster fetches it from storage, not through the operator's machine)."""
    storage, workdir = tmp_path / "kept-storage", tmp_path / "own-code"
    workdir.mkdir()
    runs = (("k", "kept-a", ["--requeue"], 40), ("l", "kept-b", ["--resume-from", "kept-a"], 80))
    for letter, run_id, extra, steps in runs:
        with own_cluster(tmp_path, letter, nodes=1, storage_dir=storage) as desc:
            cluster_file = local_state_dir(desc) / "cluster.json"
            args = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--run-id", run_id, *extra]
            proc = cli(*args, "--follow", "--", *with_steps(steps), timeout=300)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
            metrics = json.loads((run_dir(desc, run_id) / "metrics.json").read_text())
            if letter == "k":
                kept = keep_own_checkpoint(desc, cluster_file, workdir, "kept-own-a")
            else:
                resume_own_checkpoint(desc, cluster_file, workdir, "kept-own-a", "kept-own-b", kept)
    assert metrics["steps"] == 80 and metrics["resumed_from_step"] == 40, metrics


def with_steps(steps: int) -> list[str]:
    args = list(JOB_ARGS)
    args[args.index("--steps") + 1] = str(steps)
    return args
