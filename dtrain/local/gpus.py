"""Emulated GPUs on the local cluster (`local up --gpus-per-node N`): Slurm gres backed by device files,
so that a job's GPUs take Slurm's real allocation path and its real device isolation.

Each node declares N GPUs in gres.conf, `File=` naming character devices made for the cluster
(`/run/hvd-local/<hash>/dev/nvidia0..N-1`, major 240, which Linux reserves for local use: no driver
answers it, so opening an allowed one fails with ENXIO, a denied one with EPERM). Slurm gives each
job its GPUs' indices (SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES), and task/cgroup with ConstrainDevices
denies the job's processes every other GPU's device file, as it does with /dev/nvidia* on a GPU node.

Feasibility, as checked on this machine: Debian's Slurm 22.05 has cgroup/v1 and cgroup/v2 plugins; the
machine mounts cgroup v1 controllers (the devices controller among them) with only a controller-less
cgroup2 beside them, so the v1 plugin is the one that can constrain devices here. A node's namespaces
get a fresh /sys (`ip netns exec`), so its sshd mounts the devices hierarchy there, and gives each
node a cgroup of its own (`hvd-local-<hash>-<node>`) as its root, so that two nodes, or two local
clusters, never share Slurm's job cgroups. Where the machine has no cgroup v1 devices controller
(cgroup v2 only, or no delegation inside a container), `up` refuses --gpus-per-node and says why.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from dtrain.errors import ExitCode, OperatorError
from dtrain.fileio import atomic_write
from dtrain.local.slurm_conf import SlurmFiles
from infra.cloud_init.slurm import render_gres_conf

DEVICE_MAJOR = 240  # Linux's devices.txt: 240-254 are for local and experimental use
HOST_DEVICES_CGROUP = Path("/sys/fs/cgroup/devices")  # the cgroup v1 devices hierarchy, as the host mounts it
NODE_CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_CONF = (
    # v1: the devices controller this machine has; Slurm's own mount point, mounted by each node's sshd
    f"CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nCgroupMountpoint={NODE_CGROUP_ROOT}\nConstrainDevices=yes\n"
)


def check_devices_cgroup() -> None:
    """Emulated GPUs need the cgroup v1 devices controller, writable by us."""
    allow = HOST_DEVICES_CGROUP / "devices.allow"
    if not allow.exists() or not os.access(HOST_DEVICES_CGROUP, os.W_OK):
        raise OperatorError(
            f"--gpus-per-node needs the cgroup v1 devices controller at {HOST_DEVICES_CGROUP}, writable by root "
            "(Debian's Slurm 22.05 constrains devices with it here); this machine has none: run without "
            "--gpus-per-node",
            ExitCode.NOT_READY,
        )


def device_dir(files: SlurmFiles) -> Path:
    return files.runtime / "dev"


def make_devices(files: SlurmFiles, count: int) -> None:
    """The GPUs' device files, shared by every node (each node's Slurm allocates its own)."""
    directory = device_dir(files)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    for index in range(count):
        path = directory / f"nvidia{index}"
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(DEVICE_MAJOR, index))


def configure(files: SlurmFiles, count: int) -> None:
    """The device files, gres.conf and cgroup.conf (beside slurm.conf, where slurmd reads them)."""
    make_devices(files, count)
    atomic_write(files.conf.with_name("gres.conf"), render_gres_conf(count, device_dir=str(device_dir(files))))
    atomic_write(files.conf.with_name("cgroup.conf"), CGROUP_CONF)


def node_cgroup(files: SlurmFiles, node: str) -> str:
    """The node's own cgroup in the devices hierarchy (one per node and local cluster)."""
    return f"hvd-local-{files.runtime.name}-{node}"


def mount_script(files: SlurmFiles, node: str) -> str:
    """Shell, run in the node's mount namespace before its sshd: the devices hierarchy at Slurm's mount
    point, rooted at the node's own cgroup."""
    root, cgroup = NODE_CGROUP_ROOT, node_cgroup(files, node)
    return (
        f"mount -t tmpfs cgroups {root} && mkdir {root}/all {root}/devices && "
        f"mount -t cgroup -o devices devices {root}/all && mkdir -p {root}/all/{cgroup} && "
        f"mount --bind {root}/all/{cgroup} {root}/devices && umount {root}/all && "
    )


def remove_cgroups(files: SlurmFiles, nodes: list[str]) -> None:
    """The nodes' cgroups (what Slurm left in them first, deepest first): empty once the nodes are stopped."""
    for node in nodes:
        top = HOST_DEVICES_CGROUP / node_cgroup(files, node)
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
