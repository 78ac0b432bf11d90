#!/usr/bin/python3
"""shared-release: before a node goes, stop the writers on the shared file system, flush it, unmount it.

Standard library only, Python 3.10+. Installed on the nodes of a stack with sharedStorage lustre as
/usr/local/sbin/shared-release; the Spot agent runs it (dtrain/remote/boot/spot_agent.py) on an eviction
notice once the jobs have left the node, and when the head node's power program asks before it
deallocates the node (dtrain/remote/slurm/slurm_power.py). Azure's guidance for Azure Managed Lustre is
that a client unmounts before it shuts down: a client that vanishes holds its locks until the servers
evict it, and whatever it had not written back is lost.

    shared-release --mount /shared [--grace 10] [--timeout 60]

1. Writers: every process of this machine that has something open on the mount (a file, its working
   directory, its root, a mapped file), found through /proc alone: a file system that hangs would hang a
   stat. A file descriptor names its mount (fdinfo's mnt_id), and the process's own mountinfo the
   device behind it, whatever its namespace: a container's bind mount of a run directory is the same
   device. Each gets SIGTERM, then SIGKILL if it has not ended after --grace seconds.
2. Flush: syncfs on the mount (`sync -f`), bounded.
3. Unmount: `umount`, again for a few seconds while it says busy (the kernel lets go of a writer's last
   files and of a mount namespace of its own just after the writer ends, later on a loaded machine); if
   it still fails, or hangs, `umount -f` (Lustre: the outstanding requests are aborted).

Everything ends by --timeout. The last line on stdout is a JSON summary: mount, writers (pids
signalled), killed (pids that needed SIGKILL), flushed, unmounted, at (the time of each step:
writers_stopped, flushed, unmounted), error. Exit status: 0 unmounted, or nothing mounted there; 1 it
is still mounted; 2 bad arguments.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

WAIT_STEP_S = 0.1
KILL_WAIT_S = 5  # after SIGKILL: a process in uninterruptible I/O on a dead server may never end
UNMOUNT_SETTLE_S = 10  # plain `umount` tried again while the ended writers' references go


def unescape(field):
    r"""A mountinfo path field: spaces, tabs, newlines and backslashes come as octal (\040)."""
    return field.encode("latin-1").decode("unicode_escape")


def mounts(pid="self"):
    """(mount id, device "major:minor", mount point) of each mount a process sees, in mount order."""
    found = []
    with open(f"/proc/{pid}/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            found.append((fields[0], fields[2], unescape(fields[4])))
    return found


def device_of(mount_point):
    """The device mounted on top at mount_point here, or None."""
    devices = [device for _, device, point in mounts() if point == mount_point]
    return devices[-1] if devices else None


def mount_of(path, table):
    """The device of the mount that holds path, from a process's mount table (the longest prefix)."""
    best, device = -1, None
    for _, dev, point in table:
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, device = len(point), dev
    return device


def holds(pid, device):
    """Whether the process has anything open on the device, read from /proc without touching the file system."""
    base = f"/proc/{pid}"
    try:
        table = mounts(pid)
        by_id = {mount_id: dev for mount_id, dev, _ in table}
        for link in ("cwd", "root", "exe"):
            try:
                if mount_of(os.readlink(f"{base}/{link}").removesuffix(" (deleted)"), table) == device:
                    return True
            except OSError:
                continue
        for fd in os.listdir(f"{base}/fdinfo"):
            try:
                with open(f"{base}/fdinfo/{fd}") as handle:
                    info = dict(line.split(":", 1) for line in handle if ":" in line)
            except OSError:
                continue
            if by_id.get(info.get("mnt_id", "").strip()) == device:
                return True
        with open(f"{base}/maps") as handle:
            mapped = {line.split()[3] for line in handle if len(line.split()) > 5}
        return any(":".join(str(int(part, 16)) for part in dev.split(":")) == device for dev in mapped)
    except (OSError, ValueError):
        return False  # gone meanwhile, or a kernel thread


def users(device):
    """Every process but this one that has something open on the device."""
    me = str(os.getpid())
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and entry != me and holds(entry, device)]


def alive(pid):
    """Still a running process (a zombie has ended: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_all(pids, signum):
    for pid in pids:
        with contextlib.suppress(OSError):  # ended meanwhile
            os.kill(pid, signum)


def wait_gone(pids, deadline):
    """Until the processes have ended or the deadline; returns those still alive."""
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(WAIT_STEP_S)
        left = [pid for pid in left if alive(pid)]
    return left


def stop_writers(device, grace_s, deadline):
    """SIGTERM to every process on the device (and to those that appear meanwhile), SIGKILL after grace_s;
    returns (signalled, killed)."""
    writers = users(device)
    signal_all(writers, signal.SIGTERM)
    left = wait_gone(writers, min(deadline, time.monotonic() + grace_s))
    late = [pid for pid in users(device) if pid not in writers]  # started while the others ended
    killed = sorted(set(left + late))
    signal_all(killed, signal.SIGKILL)
    wait_gone(killed, min(deadline, time.monotonic() + KILL_WAIT_S))
    return sorted(set(writers + late)), killed


def bounded(argv, deadline, report=True):
    """Run argv until it ends or the deadline; True when it ended with 0 (report: say on stderr why not). A
    process stuck in the kernel on a dead server may outlive its SIGKILL: it is then left, not waited for."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(WAIT_STEP_S)
    if proc.poll() is None:
        proc.kill()
        print(f"shared-release: {' '.join(argv)} did not end in time", file=sys.stderr)
        return False
    if proc.returncode and report:
        said = proc.stderr.read().decode(errors="replace").strip()
        print(f"shared-release: {' '.join(argv)}: {said}", file=sys.stderr)
    return proc.returncode == 0


def unmount(mount, device, deadline):
    """`umount` until it succeeds or UNMOUNT_SETTLE_S have passed (the last failure said), then `umount -f`."""
    settle = min(deadline, time.monotonic() + UNMOUNT_SETTLE_S)
    while device_of(mount) == device:
        last = time.monotonic() + WAIT_STEP_S >= settle
        if bounded(["umount", mount], settle, report=last) or last:
            break
        time.sleep(WAIT_STEP_S)
    if device_of(mount) == device:
        bounded(["umount", "-f", mount], deadline)


def release(mount, grace_s, timeout_s):
    deadline = time.monotonic() + timeout_s
    summary = {"mount": mount, "writers": [], "killed": [], "flushed": False, "unmounted": False, "at": {}}
    device = device_of(mount)
    if device is None:
        summary.update(unmounted=True, error=f"nothing mounted at {mount}")
        return summary
    summary["writers"], summary["killed"] = stop_writers(device, grace_s, deadline)
    summary["at"]["writers_stopped"] = time.time()
    summary["flushed"] = bounded(["sync", "-f", mount], deadline)
    summary["at"]["flushed"] = time.time()
    unmount(mount, device, deadline)
    summary["unmounted"] = device_of(mount) != device
    if summary["unmounted"]:
        summary["at"]["unmounted"] = time.time()
    else:
        summary["error"] = f"{mount} is still mounted after umount -f"
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mount", required=True, help="the shared file system's mount point")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (%(default)s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for everything (%(default)s)")
    args = parser.parse_args(argv)
    if not os.path.isabs(args.mount) or args.grace < 0 or args.timeout <= 0:
        parser.error("--mount must be an absolute path, --grace 0 or more, --timeout more than 0")
    summary = release(os.path.normpath(args.mount), args.grace, args.timeout)
    print(json.dumps(summary))
    return 0 if summary["unmounted"] else 1


if __name__ == "__main__":
    sys.exit(main())
