"""The Ctrl-C prompt of `launch --follow` and `logs -f`, read off a real terminal (a pty)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from dtrain.cluster.slurm import QueuedJob
from dtrain.jobs.follow import queue_news

ASK = """
from dtrain.jobs.follow import ask_cancel_or_detach
from dtrain.jobs.runs import Run
raise SystemExit(ask_cancel_or_detach(None, Run("run-1", "7")))
"""


def read_until(fd: int, wanted: str, timeout: float = 30) -> str:
    """What the terminal showed until ``wanted`` appeared (or the timeout), without its colours."""
    seen, deadline = "", time.monotonic() + timeout
    while wanted not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                break
    return re.sub(r"\x1b\[[0-9;]*m", "", seen)


def test_the_ctrl_c_prompt_shows_its_choices_on_a_terminal() -> None:
    controller, terminal = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", ASK], stdin=terminal, stdout=terminal, stderr=terminal, close_fds=True
    )
    os.close(terminal)
    try:
        shown = read_until(controller, "etach? ")
        assert "job 7 (run run-1) is still running: [c]ancel it, or [d]etach? " in shown, shown
        os.write(controller, b"d\r")
        shown += read_until(controller, "runs on")
        assert "detached: job 7 (run run-1) runs on" in shown, shown
        assert child.wait(timeout=30) == 130  # ExitCode.INTERRUPTED
    finally:
        child.kill()
        os.close(controller)


def test_a_pending_job_says_why_it_waits_and_nothing_where_slurm_gives_no_reason():
    def job(state: str, reason: str) -> QueuedJob:
        return QueuedJob("7", "run-1", state, "root", "2", "0:00", reason)

    assert queue_news(job("PENDING", "(Resources)")) == "PENDING (Resources)"
    assert queue_news(job("PENDING", "(None)")) == "PENDING"  # not `PENDING (None)`
    assert queue_news(job("RUNNING", "node-[0-1]")) == "RUNNING"
