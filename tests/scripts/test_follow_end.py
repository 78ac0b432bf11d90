"""`logs -f` and `launch --follow` end when the job has: a job that Slurm keeps COMPLETING (a node not
responding, or still powering up for a job cancelled before it started) is reported after a bounded
wait, unless it may yet be requeued; a cancelled job is reported as cancelled. Slurm and SSH are stand-ins
here: the state is what is tested."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from dtrain.cluster.slurm import QueuedJob
from dtrain.jobs import follow
from dtrain.jobs.runs import Run


class Completing:
    """squeue's answer for a job held in COMPLETING until `released` is set."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def queue(self, job_id: str) -> list[QueuedJob]:
        if self.released.is_set():
            return []
        return [QueuedJob(job_id, "run-1", "COMPLETING", "root", "1", "1:05", "node-0")]


class QuietLog:
    """SSH whose `tail -F` of the log prints nothing and never ends, as on a job that never started."""

    login = "login"

    def popen(self, _target: object, _command: str, **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(["sleep", "600"], stdout=subprocess.PIPE, start_new_session=True, **kwargs)  # type: ignore[call-overload]


def follow_in_thread(slurm: Completing, run: Run) -> threading.Thread:
    thread = threading.Thread(target=follow.stream_until_done, args=(QuietLog(), slurm, run, print), daemon=True)
    thread.start()
    return thread


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follow, "POLL_S", 0.1)
    monkeypatch.setattr(follow, "TAIL_SETTLE_S", 0.0)
    monkeypatch.setattr(follow, "COMPLETING_WAIT_S", 1.0)


def test_follow_of_a_job_slurm_keeps_completing_ends_after_a_bounded_wait(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    thread = follow_in_thread(Completing(), Run("run-1", "7", "/runs/run-1", job={"requeue": False}))
    thread.join(timeout=20)
    assert not thread.is_alive(), "follow waited for Slurm to let a cancelled job go"
    assert time.monotonic() - started < 10
    assert "job 7 has ended; Slurm is still cleaning up on node-0" in capsys.readouterr().err


def test_a_job_that_may_be_requeued_is_followed_until_slurm_lets_it_go() -> None:
    slurm = Completing()  # squeue shows a job being requeued as COMPLETING too
    thread = follow_in_thread(slurm, Run("run-1", "7", "/runs/run-1", job={"requeue": True}))
    thread.join(timeout=3)
    assert thread.is_alive()
    slurm.released.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_cancelled_job_is_reported_as_cancelled_not_as_a_failed_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # what scancel of a running Horovod job leaves: exit 143, and the launcher blaming the first rank it lost
    verdict = {"failed_rank": 0, "failed_host": "node-0", "job_error": "RuntimeError: Horovod detected that one"}
    run = Run(None, "7", "/runs/run-1", job={}, status={"exit_code": 143, "results": "uploaded"}, verdict=verdict)
    assert follow.outcome(None, None, run) == 143  # type: ignore[arg-type]
    shown = capsys.readouterr().err
    assert "job 7: cancelled" in shown and "failed" not in shown, shown
