"""A CPU limit on running processes, through a cgroup of their own: how the tests make one rank (or one
node's ranks) slow from outside the job, as a throttled or faulty node would be. Shared by the suites of
both environments.

cgroup v2 (``cpu.max``) where the unified hierarchy has the cpu controller, else cgroup v1's cpu
controller (``cpu.cfs_quota_us``); :func:`cgroup_cpu_problem` says why neither can be used (not root, no
writable cpu controller), for a test to skip with. Moving a process moves all its threads, and what it
starts later inherits the limit. On leaving, the processes still alive go back to their own cgroups.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _v2_root() -> Path | None:
    """The unified hierarchy, where it has the cpu controller."""
    for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "cpu" in controllers.read_text().split():
            return root
    return None


def _v1_root() -> Path | None:
    for root in (CGROUP_ROOT / "cpu", CGROUP_ROOT / "cpu,cpuacct"):
        if (root / "cpu.cfs_quota_us").is_file():
            return root
    return None


def cgroup_cpu_problem() -> str | None:
    """Why no CPU limit can be set here; None where one can."""
    if os.geteuid() != 0:
        return "a cgroup CPU limit needs root"
    root = _v2_root() or _v1_root()
    if root is None:
        return "no cgroup cpu controller is mounted (v2 cpu.max or v1 cpu.cfs_quota_us)"
    if not os.access(root, os.W_OK):
        return f"the cgroup cpu controller at {root} is not writable"
    return None


def _own_cgroup(pid: int, v2: bool) -> str | None:
    """The process's cgroup in the hierarchy used (v2's `0::`, v1's line naming the cpu controller)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if (v2 and number == "0") or (not v2 and "cpu" in controllers.split(",")):
            return path
    return None


@contextlib.contextmanager
def cpu_limited(pids: Iterable[int], percent_of_one_cpu: float) -> Iterator[Path]:
    """The processes, together, get at most this share of one CPU until the block ends."""
    v2_root = _v2_root()
    root = v2_root or _v1_root()
    assert root is not None, cgroup_cpu_problem()
    group = root / f"dtrain-test-slow-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    quota = max(1000, int(PERIOD_US * percent_of_one_cpu / 100))
    moved: dict[int, str | None] = {}
    try:
        if v2_root is not None:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        for pid in pids:
            moved[pid] = _own_cgroup(pid, v2_root is not None)
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # it ended meanwhile
                (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            back = moved.get(int(pid)) or "/"
            with contextlib.suppress(OSError):
                (root / back.lstrip("/") / "cgroup.procs").write_text(pid)
        group.rmdir()
