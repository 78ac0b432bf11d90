"""A rank that stops answering ends the job, and the error names that rank and its host.

SIGSTOP makes the worst kind of hung rank: alive, holding its sockets open, silent. The job
must exit non-zero within the bound docs/training.md gives, and the one error line must blame
the stopped rank, not the healthy rank that noticed the timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.training.jobs import (
    TINY,
    error_lines,
    horovodrun,
    kill_tree,
    run,
    start,
    torchrun,
    wait_exit,
    worker_pid,
)
from training.world.liveness import PROBE_TIMEOUT_SECONDS, Liveness, Peer

PEER_TIMEOUT = 10  # seconds, for these runs (the default is 60; the environment wins)
# The documented bound: the peer timeout, the probe that names the rank, then the launcher's
# grace before it SIGKILLs a worker that ignores SIGTERM, as a stopped one does.
LAUNCHER_GRACE = {"horovod": 5, "ddp": 30}
SLACK = 10  # process scheduling on a shared 2-core machine


@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_bound(tmp_path: Path, backend: str) -> None:
    args = [*TINY, "--steps", 100_000, "--log-every", 20]
    cmd = horovodrun(2, "pytorch", *args) if backend == "horovod" else torchrun(2, *args, "--backend", "ddp")
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(PEER_TIMEOUT), "DDP_TIMEOUT_SECONDS": str(PEER_TIMEOUT)}
    log = tmp_path / "job.log"
    proc = start(cmd, log, env)
    try:
        victim = worker_pid(proc, rank=1)
        wait_for(lambda: "step 20/" in log.read_text(), timeout=120, what="the first steps")
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        rc = wait_exit(proc, PEER_TIMEOUT + PROBE_TIMEOUT_SECONDS + LAUNCHER_GRACE[backend] + SLACK)
    finally:
        kill_tree(proc)
    output = log.read_text()
    assert rc != 0
    assert time.monotonic() - stopped_at > PEER_TIMEOUT  # ended by the timeout, not by something else
    host = socket.gethostname()
    [line] = [line for line in error_lines(output) if "stopped answering" in line]
    waited = f"no reply within the {PEER_TIMEOUT} s peer timeout, nor to a ping within {PROBE_TIMEOUT_SECONDS:g} s"
    assert f"error: rank 1 on host {host} stopped answering ({waited})" in line  # the time it did wait
    assert f"; rank 0 on host {host} noticed: " in line
    assert output.count("Traceback (most recent call last)") == 1  # the launcher's own, for a failed job


def test_a_checkpoint_save_three_times_the_peer_timeout_does_not_end_a_healthy_job(tmp_path: Path) -> None:
    """Rank 0's first checkpoint file takes 3x the peer timeout to write (tests/training/slow_save_job.py):
    training goes on meanwhile, and the job ends well, with both checkpoints written."""
    peer_timeout = 4
    env = {
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(peer_timeout),
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(peer_timeout // 2),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(peer_timeout),
        "SLOW_SAVE_SECONDS": str(3 * peer_timeout),
    }
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--steps", 4, "--log-every", 1, "--checkpoint-dir", ckpt, "--checkpoint-every", 2]
    cmd = [*horovodrun(2, "pytorch", *args)]
    cmd[cmd.index("-m") : cmd.index("training.pytorch") + 1] = [Path(__file__).with_name("slow_save_job.py")]
    output = run(cmd, tmp_path / "job.log", timeout=120, env=env)
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-0000000002.ckpt", "ckpt-0000000004.ckpt"]
    # the last step was taken while step 2's file was still being written
    assert output.index("step 4/4") < output.index("saved checkpoint " + str(ckpt / "ckpt-0000000002.ckpt"))


class OneOfTwo:
    """Rank ``rank`` of two in this process: the allgather adds the other rank's Peer, if known."""

    backend, size, local_rank, local_size = "test", 2, 0, 2

    def __init__(self, rank: int, other: Peer | None = None) -> None:
        self.rank, self.other = rank, other

    def allgather_object(self, obj: Peer) -> list[Peer]:
        return sorted([obj, self.other or obj], key=lambda peer: peer.rank)


def test_liveness_tells_a_live_peer_from_a_silent_or_departed_one() -> None:
    second = Liveness(OneOfTwo(1), {})
    first = Liveness(OneOfTwo(0, second.me), {})
    assert [str(peer) for peer in first.peers] == [f"rank {r} on host {socket.gethostname()}" for r in (0, 1)]
    assert first.troubled_peers(timeout=2) == {}  # rank 1 answers

    # A listening socket that nobody accepts on: the kernel completes the handshake, as for a
    # stopped process, and no reply ever comes.
    with socket.create_server(("127.0.0.1", 0)) as frozen, socket.create_server(("127.0.0.1", 0)) as closed:
        departed_port = closed.getsockname()[1]
        closed.close()  # a process that exited: its port refuses connections
        first.peers = [
            first.me,
            Peer(1, "frozen-host", "127.0.0.1", frozen.getsockname()[1]),
            Peer(2, "gone-host", "127.0.0.1", departed_port),
        ]
        troubled = first.troubled_peers(timeout=0.5)
    assert {str(peer): problem for peer, problem in troubled.items()} == {
        "rank 1 on host frozen-host": "stopped answering (no reply within 0.5 s)",
        "rank 2 on host gone-host": "has exited",
    }
