"""Stopping processes we started: by pid, TERM first, KILL for what is left; never by name.

A pid alone can be recycled: `matches` confirms a recorded pid is still the process we started by
a string from its command line. A job's processes on the nodes are Slurm's to stop, not ours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL)


def matches(pid: int, marker: str) -> bool:
    """Whether pid is alive and marker is in its command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


def children(pid: int) -> list[int]:
    """The live children of pid."""
    return _children_by_parent().get(pid, [])


def descendants(pid: int) -> list[int]:
    """All live descendants of pid."""
    by_parent = _children_by_parent()
    found, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, through the parent pid in /proc/*/stat."""
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        by_parent.setdefault(ppid, []).append(int(entry.name))
    return by_parent


def stop_pids(pids: list[int], grace_s: float = 3.0, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
    """TERM the given pids, wait up to grace_s for them to end, then KILL what is left (signals: the
    signals to send in turn, each followed by that wait)."""
    live = [p for p in pids if Path(f"/proc/{p}").exists()]
    for sig in signals:
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + grace_s
        while time.time() < deadline:
            live = [p for p in live if _running(p)]
            if not live:
                return
            time.sleep(0.05)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Stop a child started in its own session (start_new_session=True), with everything in its group."""
    if proc.poll() is not None:
        return
    for sig in STOP_SIGNALS:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace_s
        while time.time() < deadline:
            if proc.poll() is not None:
                return
            time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":  # a zombie of ours: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True
