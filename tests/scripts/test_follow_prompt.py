"""The Ctrl-C prompt of `launch --follow` and `logs -f`, read off a real terminal (a pty)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

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
