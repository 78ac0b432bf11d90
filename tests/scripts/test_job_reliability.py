"""Faults on the local cluster (real Slurm, sshd, Horovod across two node namespaces): a data directory
that does not decode, a worker killed mid-run, SSH to the login host and slurmctld gone for 20 s. The
job must end with the right status and blame, leave no process on any node, and the operator's
follow and cancel must wait out an outage instead of reading it as an answer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dtrain.cluster import slurm as slurm_module
from dtrain.cluster.slurm import OUTAGE_PATIENCE_S, Result, Slurm, SlurmUnreachable, patiently
from dtrain.datasets import staging
from dtrain.errors import ExitCode
from dtrain.local import slurm_conf
from dtrain.local.nodes import start_daemon
from dtrain.local.state import load_state
from dtrain.processes import descendants
from tests.polling import wait_for

from .conftest import local_state_dir, run_module, start_module
from .test_launcher import (
    CLI,
    cli,
    cmdline,
    follow_until_both_ranks_run,
    job_id_of,
    launch_args,
    node_namespaces,
    run_dir,
    squeue_state,
    start_long_job,
)

OUTAGE_S = 20
LEFTOVER_BOUND_S = 30  # after the job's end, nothing of it may be left on any node


def job_processes(job_id: str) -> list[int]:
    """Live processes of a Slurm job on any node of the session's cluster: each carries SLURM_JOB_ID in its
    environment (other clusters on this machine number their jobs from 1 too: only our nodes count)."""
    needle = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for namespace in node_namespaces():
        for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
            entry = Path(f"/proc/{pid}")
            try:
                if entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                    continue
                if needle in entry.joinpath("environ").read_bytes().split(b"\0"):
                    found.append(int(pid))
            except (OSError, IndexError):
                continue
    return found


def left_of(job_id: str, bound: float = LEFTOVER_BOUND_S) -> list[str]:
    """What of the job is still running ``bound`` seconds from now (pid and command line), if anything."""
    deadline = time.monotonic() + bound
    while (pids := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [f"{pid}: {cmdline(pid)}" for pid in pids]


def rank_pid(job_id: str, rank: int) -> int | None:
    for pid in job_processes(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"HOROVOD_RANK={rank}".encode() in environ and b"training.pytorch" in cmdline:
            return pid
    return None


def tiny_imagenet(cluster, name: str) -> Path:
    root = Path(cluster.data_path) / name
    if not root.exists():
        staging.generate_synthetic_imagenet(root, classes=2, train_per_class=8, val_per_class=1, image_size=32)
    return root


def pytorch_launch(cluster_file: Path, data: Path, run_id: str, *extra: str, steps: int = 4) -> list[str]:
    job = ["--data", "imagenet", "--data-dir", str(data), "--model", "resnet_tiny", "--image-size", "32"]
    job += [
        "--batch-size",
        "4",
        "--steps",
        str(steps),
        "--data-workers",
        "1",
        "--warmup-epochs",
        "0",
        "--log-every",
        "1",
    ]
    launch = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2"]
    return [*launch, "--run-id", run_id, *extra, "--", *job]


def test_launch_on_undecodable_data_ends_with_bad_input_and_one_error_line(cluster, cluster_file):
    data = Path(cluster.data_path) / "truncated-imagenet"
    staging.generate_synthetic_imagenet(data, classes=2, train_per_class=8, val_per_class=1, image_size=32)
    for path in data.rglob("*.JPEG"):
        path.write_bytes(path.read_bytes()[:100])
    started = time.monotonic()
    proc = cli(*pytorch_launch(cluster_file, data, "truncated-run", "--follow"), timeout=120)
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and took < 60, (took, out[-3000:])  # bad input, whichever rank failed first
    errors = [line for line in out.splitlines() if re.match(r"^\[\d+\|node-\d\]!? error: ", line)]
    assert len(errors) == 1 and "images in a row under" in errors[0], out[-3000:]
    job_id = job_id_of(proc)
    assert left_of(job_id) == []


def test_a_killed_worker_is_blamed_and_leaves_nothing_behind(cluster, cluster_file):
    """SIGKILL of rank 1 (node-1), whose decode worker then has no parent: the job ends, verdict.json
    and `jobs` name rank 1 on node-1 (not rank 0, which noticed and exited first), and no process of the
    job (decode workers included) is left on either node."""
    data = tiny_imagenet(cluster, "killed-imagenet")
    proc = cli(*pytorch_launch(cluster_file, data, "killed-run", "--detach", steps=100_000))
    assert proc.returncode == 0, proc.stderr
    job_id = job_id_of(proc)
    log = run_dir(cluster, "killed-run") / "output.log"
    stepping = re.compile(r"^\[0\|node-0\]!? .*step \d+/", re.M)
    wait_for(lambda: log.exists() and stepping.search(log.read_text()), 120, "the first steps", interval=0.5)
    victim = wait_for(lambda: rank_pid(job_id, 1), 30, "rank 1's process", interval=0.5)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: squeue_state(cluster, job_id) == "", 120, "the job to end", interval=0.5)
    assert left_of(job_id) == []
    verdict = json.loads((run_dir(cluster, "killed-run") / "verdict.json").read_text())
    assert (verdict["failed_rank"], verdict["failed_host"]) == (1, "node-1"), verdict
    listing = cli("jobs", "--cluster", str(cluster_file))
    assert re.search(rf"{job_id}\s.*killed-run.*FAILED.*rank 1 on node-1", listing.stdout), listing.stdout


def test_a_job_that_ended_without_its_status_says_why_slurm_ended_it(cluster, cluster_file):
    """A batch script killed before it could write its status (the OOM killer, a signal before its trap
    was set) and a job cancelled while pending: `jobs`, `logs` and `launch --follow` give Slurm's own
    word on each, not a guess."""
    running = start_long_job(cluster, cluster_file, "batch-killed")
    waiting = cli(*launch_args(cluster_file, "--steps", "1", run_id="never-started", extra=("--detach",)))
    assert waiting.returncode == 0, waiting.stderr
    pending = job_id_of(waiting)
    assert cli("cancel", "--cluster", str(cluster_file), pending).returncode == 0
    batch = [pid for pid in job_processes(running) if "slurm_script" in cmdline(pid)]
    assert len(batch) == 1, [cmdline(pid) for pid in job_processes(running)]
    os.kill(batch[0], signal.SIGKILL)
    wait_for(lambda: squeue_state(cluster, running) == "", 120, "the job to end", interval=0.5)

    killed = "batch script killed by signal 9 (SIGKILL) before it wrote its exit status"
    listing = cli("jobs", "--cluster", str(cluster_file)).stdout
    assert re.search(rf"{running}\s.*batch-killed.*FAILED.*Slurm says FAILED", listing), listing
    assert re.search(rf"{pending}\s.*never-started.*CANCELLED.*cancelled while pending", listing), listing
    rows = {row["job"]: row for row in json.loads(cli("jobs", "--cluster", str(cluster_file), "--json").stdout)["jobs"]}
    assert killed in rows[running]["note"], rows[running]
    logs = cli("logs", "--cluster", str(cluster_file), running)
    assert "ended without an exit status: Slurm says FAILED" in logs.stderr and "has not ended" not in logs.stderr
    follow = cli("logs", "--cluster", str(cluster_file), "-f", "batch-killed")
    assert follow.returncode == ExitCode.FAILED and "SIGKILL" in follow.stderr, follow.stderr[-2000:]


def jumpbox_sshds(cluster) -> list[int]:
    """The login host's sshd: its listener and the process serving each connection (not the sessions'
    shells: frozen, they would resume where they stopped)."""
    record = load_state(local_state_dir(cluster)).record("jumpbox")
    assert record is not None and record.alive()
    return [record.pid, *(pid for pid in descendants(record.pid) if cmdline(pid).startswith("sshd"))]


def stop_slurmctld(cluster) -> None:
    """Stopped as an operator stops it (SIGTERM: it saves its state). Not frozen: a controller that
    comes back from a freeze longer than the local SlurmdTimeout (10 s) finds every node silent for too
    long and fails their jobs."""
    record = load_state(local_state_dir(cluster)).record("slurmctld")
    assert record is not None and record.alive()
    os.kill(record.pid, signal.SIGTERM)
    wait_for(lambda: not record.alive(), 30, "slurmctld to stop", interval=0.2)


def start_slurmctld(cluster) -> None:
    state = load_state(local_state_dir(cluster))
    assert state.head is not None and state.head.namespace and state.slurm_conf
    argv = slurm_conf.slurmctld_argv(state.head.namespace, Path(state.slurm_conf))
    start_daemon(state, "slurmctld", argv, state.slurm_conf)


def _new_connections_to(port: int, since: set[str]) -> set[str]:
    """TCP connections to port (established or closed within the last minute) not in since."""
    listing = subprocess.run(["ss", "-tanH", f"dport = :{port}"], capture_output=True, text=True).stdout
    return {" ".join(line.split()[3:5]) for line in listing.splitlines()} - since


def test_follow_and_cancel_wait_out_outages_of_ssh_and_slurmctld(cluster, cluster_file):
    args = launch_args(cluster_file, "--steps", "600", "--sleep", "0.5", run_id="outage-run", extra=("--follow",))
    follower = follow_until_both_ranks_run(args)
    try:
        # one connection carries the follower's calls: no new one while it polls every 2 s
        port = cluster.slurm.login.port
        before = _new_connections_to(port, set())
        time.sleep(8)
        assert _new_connections_to(port, before) == set()
        # SSH to the login host silent for 20 s, as in a network partition: the listener and every
        # connection it serves frozen; the follower's connection times out (ServerAlive) and is made again
        sshds = jumpbox_sshds(cluster)
        for pid in sshds:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)
            assert follower.poll() is None  # still following: the outage is no verdict
        finally:
            for pid in sshds:
                os.kill(pid, signal.SIGCONT)
        # slurmctld stopped for 20 s and started again, with a cancel asked meanwhile
        stop_slurmctld(cluster)
        try:
            cancel = start_module(CLI, "cancel", "--cluster", str(cluster_file), "outage-run")
            time.sleep(OUTAGE_S)
            assert follower.poll() is None and cancel.poll() is None
        finally:
            start_slurmctld(cluster)
        said = cancel.communicate(timeout=OUTAGE_PATIENCE_S)[0]
        assert cancel.returncode == 0 and "cancelled: no process of it is left on any node" in said, said
        rest = follower.communicate(timeout=60)[0]
    finally:
        follower.kill()
    assert follower.returncode == 143, rest[-3000:]  # the job's own status: cancelled
    steps = re.findall(r"^\[0\|node-0\] step (\d+) ", rest, re.M)
    assert steps and len(steps) == len(set(steps)), rest[-3000:]  # the log went on, without repeats
    assert int(steps[-1]) * 0.5 > 2 * OUTAGE_S - 10  # lines from after both outages
    job_id = (run_dir(cluster, "outage-run") / "job_id").read_text().strip()
    assert left_of(job_id, 0) == []
    logs = run_module(CLI, "logs", "--cluster", str(cluster_file), "outage-run", timeout=60)
    assert logs.returncode == 0


# --- Slurm's answers and failures, without a cluster -------------------------------------------------
def test_a_failure_to_ask_slurm_is_never_read_as_no_such_job(monkeypatch):
    slurm = object.__new__(Slurm)  # its commands answered here, not over SSH
    answers = iter(
        [
            Result(1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"),
            Result(1, "", "slurm_load_jobs error: Invalid job id specified\n"),
        ]
    )
    monkeypatch.setattr(slurm, "run_unchecked", lambda command, timeout=60: next(answers), raising=False)
    with pytest.raises(SlurmUnreachable, match="Unable to contact slurm controller") as failed:
        slurm.queue("7")
    assert failed.value.exit_code == ExitCode.NOT_READY
    assert slurm.queue("7") == []  # Slurm's own answer: it holds no such job

    monkeypatch.setattr(slurm_module, "RETRY_INTERVAL_S", 0.01)
    calls: list[int] = []

    def down_twice() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise SlurmUnreachable("slurmctld restarting")
        return "RUNNING"

    assert patiently(down_twice, "about job 7", patience_s=5) == "RUNNING" and len(calls) == 3

    def down() -> str:
        raise SlurmUnreachable("slurmctld down")

    with pytest.raises(SlurmUnreachable, match="could not ask Slurm about job 7 for 0 s: slurmctld down"):
        patiently(down, "about job 7", patience_s=0.05)
