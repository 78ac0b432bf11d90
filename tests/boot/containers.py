"""The boot test's head node and GPU nodes as system containers (runs on the host, as root).

Each host boots the cached image (tools/build_boot_image.sh) under systemd-nspawn: real systemd and
cloud-init, a copy-on-write overlay of the image's root, a network namespace of its own whose `eth0` is
a veth into the hub's bridge (tests/boot/vms.py's Namespace, where Azure's endpoints answer). A
container's systemd starting and halting stands in for Azure's start and deallocate.

A container is not a VM, and this host runs no systemd and no udev: what the launch does about it
(../shared/boot-in-containers.md, section 3) is named where it is done, and `EXCLUSIONS` lists what a
container cannot show, for the test to print beside its substitutions.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.boot.vms import BRIDGE, Namespace

CGROUP_ROOT = Path("/sys/fs/cgroup")
REGISTRY = Path("/run/dtrain-boot")  # <hub>/<host>: a link to each container's overlay, for remove_stale
# How long after ARM's start call a container boots. slurmd reports its boot time as its registration's
# second less its uptime rounded up, and the container's boot clock starts up to a second early (its
# offset is whole seconds): the boot it reports can be up to 3 s before the real one, and must not be
# before the second of slurmctld's resume request, which precedes the start call.
BOOT_AFTER_START_S = 3.0
HALT_WAIT_S = 20  # an orderly halt takes about 2 s; past this the container is ended at once
# What the containers cannot show, and where it is tested instead (docs/infrastructure.md).
EXCLUSIONS = (
    "the NFS server role (RAID 0 over LUN disks, XFS, kernel nfsd, the export): no block devices or nfsd "
    "in a container; the VM harness (make test-boot-vm)",
    "real NFS mounts: /shared is a bind mount of one hub directory on every host",
    "the NVMe RAID: /nvme is a tmpfs, so nvme-raid.sh takes its 'already mounted' path "
    "(tests/boot/test_nvme_raid_vm.py builds the array in a VM)",
    "the head node's database disk: /var/lib/mysql is a directory bound there, so database-disk.sh takes its "
    "'already mounted' path (the VM harness gives the head node a disk at LUN 0)",
    "udev rules and kernel modules: the GPUs are device nodes and the InfiniBand ports an overlay of "
    "/sys/class (tools/boot_image/rootfs/usr/local/sbin/boot-hardware)",
    "Azure's node health checks (NHC in Azure's container, on real GPUs and links): a stand-in for their entry "
    "point passes, or fails the check a test names (tools/boot_image/rootfs/opt/azurehpc/test/azurehpc-health-checks); "
    "tests/infra runs the node's program against one",
    "cgroup v2 as on Azure: this host's hybrid layout gives the containers cgroup v1, which slurmd's "
    "cgroup plugin detects (CgroupPlugin=autodetect)",
    "real kernel reboots: a restart is a new container boot (no firmware, initramfs or fstab ordering)",
    "real GPUs: dcgm-exporter (NVIDIA's container runtime, a driver) restarts without end; its unit is "
    "checked by systemd-analyze (tests/infra)",
)
# Units that fail in every container, whatever the custom data: the kernel's NFS server file systems.
UNITS_FAILING_IN_ANY_CONTAINER = ("proc-fs-nfsd.mount", "run-rpc_pipefs.mount")
# slurmd's cgroup plugin writes the v1 hierarchies, which nspawn mounts read-only on a hybrid host.
SLURMD_CGROUP_DROP_IN = """\
# The boot test's container only (tests/boot/containers.py): nspawn mounts the cgroup v1 controllers
# read-only on a hybrid host, and slurmd's cgroup plugin creates its hierarchy in them.
[Service]
ExecStartPre=+/bin/sh -c "for c in freezer cpuset devices cpu cpuacct pids blkio memory; do \
mount -o remount,bind,rw /sys/fs/cgroup/$c 2>/dev/null || true; done"
"""


@dataclass
class ContainerSpec:
    name: str  # the host's name in the test (its hostname may differ in case)
    address: str
    mac: str
    gpus: int = 0  # emulated /dev/nvidia*
    infiniband_ports: int = 0  # emulated InfiniBand ports, ACTIVE at infiniband_rate_gbps
    infiniband_rate_gbps: int = 0
    nvme: bool = False  # a tmpfs at /nvme, where nvme-raid.sh finds its volume mounted
    database_disk: bool = False  # a directory of the test's at MariaDB's data directory (the head node)


@dataclass
class Container:
    spec: ContainerSpec
    image: Path  # tools/build_boot_image.sh's output; its root/ is the lower layer
    work: Path
    seed: Path  # the NoCloud seed directory, bound read-only where cloud-init looks
    hub: Namespace
    index: int
    shared: Path  # the hub directory bound at /shared (the NFS export's stand-in)
    files: dict[str, bytes] = field(default_factory=dict)  # path -> content, laid into the overlay before boot
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    boots: int = field(default=0, init=False)
    start_requested: float = field(default=0.0, init=False)
    power_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.netns = f"{self.hub.name}-{self.index}"
        self.root = self.work / "root"
        for directory in (self.work / "upper", self.work / "overlay-work", self.root):
            directory.mkdir(parents=True, exist_ok=True)
        for path, content in self._boot_files().items():
            target = self.work / "upper" / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        peer = f"v{self.index}"
        for command in (
            ["ip", "-n", self.netns, "link", "set", "lo", "up"],
            [
                "ip",
                "-n",
                self.hub.name,
                "link",
                "add",
                peer,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                self.netns,
            ],
            ["ip", "-n", self.netns, "link", "set", "eth0", "address", self.spec.mac],
            ["ip", "-n", self.hub.name, "link", "set", peer, "master", BRIDGE, "up"],
        ):
            subprocess.run(command, check=True, capture_output=True)
        self.cgroups = _make_cgroups(f"{self.hub.name}/{self.spec.name}")
        registered = REGISTRY / self.hub.name / self.spec.name
        registered.parent.mkdir(parents=True, exist_ok=True)
        registered.unlink(missing_ok=True)
        registered.symlink_to(self.root)

    def _boot_files(self) -> dict[str, bytes]:
        # The kernel command line is the host's: boot-hardware reads its arguments from this file.
        spec = self.spec
        args = f"boot.gpus={spec.gpus} boot.ib={spec.infiniband_ports} boot.ib_rate={spec.infiniband_rate_gbps}\n"
        return {"/etc/boot-hardware.args": args.encode(),
                "/etc/systemd/system/slurmd.service.d/boot-test-cgroup.conf": SLURMD_CGROUP_DROP_IN.encode(),
                **self.files}  # fmt: skip

    @property
    def console(self) -> Path:
        return self.work / f"console-{self.boots}.log"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Power on (Azure's start): the OS disk as it was left; a tmpfs /nvme is empty again."""
        with self.power_lock:
            self._start()

    def _start(self) -> None:
        if self.running():
            return
        # slurmctld takes a node that booted before its resume request for one that never rebooted (and
        # waits for it until ResumeTimeout); a real VM always boots after the request. See BOOT_AFTER_START_S.
        time.sleep(max(0.0, self.start_requested + BOOT_AFTER_START_S - time.monotonic()))
        if not os.path.ismount(self.root):
            lower, upper, work = self.image / "root", self.work / "upper", self.work / "overlay-work"
            layers = f"lowerdir={lower},upperdir={upper},workdir={work}"
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o", layers, str(self.root)], check=True)
        self.boots += 1
        uptime_s = int(float(Path("/proc/uptime").read_text().split()[0]))
        nspawn = ["systemd-nspawn", "-D", str(self.root), "--boot", f"--machine={self.spec.name}",
                  # no host systemd to register with, and the cgroup made here is the container's
                  "--register=no", "--keep-unit", "--private-users=no",
                  # only with a private network does nspawn keep CAP_NET_ADMIN, a writable /proc/sys/net
                  # (docker) and the container's own /sys/class/net (cloud-init)
                  "--private-network", "--network-interface=eth0", "--console=pipe",
                  f"--bind-ro={self.seed}:/var/lib/cloud/seed/nocloud", f"--bind={self.shared}:/shared"]  # fmt: skip
        if self.spec.nvme:
            nspawn.append("--tmpfs=/nvme:mode=1777")
        if self.spec.database_disk:  # kept across boots, as the head node's data disk is
            disk = self.work / "database-disk"
            disk.mkdir(exist_ok=True)
            nspawn.append(f"--bind={disk}:/var/lib/mysql")
        argv = [
            # a time namespace whose boot clock starts at 0: Slurm reads a node's boot time from it
            "unshare", "--fork", "--kill-child", "--time", f"--boottime=-{uptime_s}",
            "nsenter", f"--net=/run/netns/{self.netns}",
            # /sys read-only in a mount namespace of its own: nspawn then skips its udev check
            # (this host runs no udev; "network interface eth0 is not initialized yet")
            "unshare", "-m", "--propagation", "slave",
            "sh", "-c", 'mount -o remount,bind,ro /sys && exec "$0" "$@"', *nspawn,
        ]  # fmt: skip
        console = self.console.open("ab")
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: _join_cgroups(self.cgroups),
        )
        console.close()

    def request_start(self) -> None:
        """ARM's start call: the boot follows in a later second than the request (see start)."""
        self.start_requested = time.monotonic()
        self.start()

    def stop(self) -> None:
        """Power off (Azure's deallocate): systemd is asked to halt, then the container is ended. ARM's
        calls come on threads of their own: one stop or start at a time."""
        with self.power_lock:
            self._stop()

    def _stop(self) -> None:
        if self.process is None:
            return
        nspawn = self._nspawn_pid()
        if self.process.poll() is None and nspawn:
            os.kill(nspawn, signal.SIGTERM)  # an orderly halt
            try:
                self.process.wait(HALT_WAIT_S)
            except subprocess.TimeoutExpired:
                os.kill(nspawn, signal.SIGTERM)  # nspawn's second SIGTERM ends the container at once
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            _kill_cgroups(self.cgroups)
            self.process.wait()
        _kill_cgroups(self.cgroups)
        _wait_empty(self.cgroups, HALT_WAIT_S)
        self.process = None

    def _nspawn_pid(self) -> int | None:
        """nspawn's process id: the last of the chain unshare -> nsenter -> unshare -> sh -> nspawn."""
        assert self.process is not None
        pid, seen = self.process.pid, 0
        while seen < 6:
            if Path(f"/proc/{pid}/comm").exists() and Path(f"/proc/{pid}/comm").read_text().strip() == "systemd-nspawn":
                return pid
            children = Path(f"/proc/{pid}/task/{pid}/children")
            kids = children.read_text().split() if children.exists() else []
            if not kids:
                return None
            pid, seen = int(kids[0]), seen + 1
        return None

    def leader(self) -> int | None:
        """The container's PID 1 (its systemd), as the host numbers it."""
        nspawn = self._nspawn_pid() if self.running() else None
        if nspawn is None:
            return None
        kids = Path(f"/proc/{nspawn}/task/{nspawn}/children").read_text().split()
        return int(kids[0]) if kids else None

    def mask(self, unit: str) -> None:
        """Masks a unit on the (stopped) host's disk, as a broken image or package would leave it."""
        link = self.root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")

    def unmask(self, unit: str) -> None:
        (self.root / "etc/systemd/system" / unit).unlink(missing_ok=True)

    def read(self, path: str) -> str:
        """A file on the host's disk, whether the host runs or not ("" when there is none)."""
        target = self.root / path.lstrip("/")
        return target.read_text(errors="replace") if target.is_file() else ""

    def write(self, path: str, content: str | None) -> None:
        """A file on the host's disk (None: removed), as an operator or a fault leaves it, for its next boot."""
        target = self.root / path.lstrip("/")
        if content is None:
            target.unlink(missing_ok=True)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)

    def run(self, command: str, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """command as root inside the running container, in all of its namespaces."""
        leader = self.leader()
        if leader is None:
            raise RuntimeError(f"{self.spec.name} is not running")
        argv = ["nsenter", "-t", str(leader), "-m", "-u", "-i", "-n", "-p", "-C", "-T", "--", "sh", "-c", command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)

    def delete(self) -> None:
        self.stop()
        if os.path.ismount(self.root):
            subprocess.run(["umount", "-l", str(self.root)], check=False)
        _remove_cgroups(self.cgroups)
        subprocess.run(["ip", "netns", "delete", self.netns], check=False, capture_output=True)
        (REGISTRY / self.hub.name / self.spec.name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (REGISTRY / self.hub.name).rmdir()


def _hierarchies() -> list[Path]:
    """The host's cgroup hierarchies, each once (cpu and cpuacct are links to one)."""
    seen: dict[Path, None] = {}
    for entry in sorted(CGROUP_ROOT.iterdir()):
        real = entry.resolve()
        if real.is_dir() and (real / "cgroup.procs").exists():
            seen.setdefault(real)
    return list(seen)


def _make_cgroups(relative: str) -> list[Path]:
    """A cgroup of the container's own in every hierarchy, as a host systemd's scope would be: without
    it, every container's systemd would manage one shared tree ("Failed to kill control group")."""
    made = []
    for hierarchy in _hierarchies():
        path = hierarchy
        for part in relative.split("/"):
            parent, path = path, path / part
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):  # a cpuset cgroup admits no task until set
                if (path / name).exists() and not (path / name).read_text().strip():
                    (path / name).write_text((parent / name).read_text())
        made.append(path)
    return made


def _join_cgroups(cgroups: list[Path]) -> None:
    for cgroup in cgroups:
        (cgroup / "cgroup.procs").write_text("0\n")


def _kill_cgroups(cgroups: list[Path]) -> None:
    """SIGKILL to whatever is left in the container's cgroups (what a deallocated VM's power cut ends)."""
    for cgroup in cgroups:
        for procs in cgroup.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _wait_empty(cgroups: list[Path], timeout_s: float) -> None:
    """Until no process is left in cgroups (SIGKILLed processes take a moment to go), or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while any(procs.read_text().strip() for cgroup in cgroups for procs in cgroup.rglob("cgroup.procs")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _remove_cgroups(cgroups: list[Path]) -> None:
    for cgroup in cgroups:
        for directory, _, _ in sorted(os.walk(cgroup), key=lambda entry: -len(entry[0])):
            with contextlib.suppress(OSError):  # a cgroup still in use stays
                os.rmdir(directory)
        with contextlib.suppress(OSError):
            cgroup.parent.rmdir()  # the test's own level, once its last container is gone


def remove_stale(prefix: str) -> list[str]:
    """What runs that were killed before their cleanup left (their containers' processes, overlays,
    cgroups and network namespaces), for every hub namespace prefix<pid> whose process is gone; their names."""
    hubs = {
        match[1]
        for entry in Path("/run/netns").glob(f"{prefix}*")
        if (match := re.fullmatch(rf"({re.escape(prefix)}(\d+))(?:-\d+)?", entry.name))
        and not Path(f"/proc/{match[2]}").exists()
    }
    for hub in sorted(hubs):
        cgroups = [hierarchy / hub for hierarchy in _hierarchies() if (hierarchy / hub).is_dir()]
        _kill_cgroups(cgroups)
        _wait_empty(cgroups, HALT_WAIT_S)
        for root in sorted((REGISTRY / hub).glob("*")):
            subprocess.run(["umount", "-l", str(root.resolve())], check=False, capture_output=True)
        shutil.rmtree(REGISTRY / hub, ignore_errors=True)
        _remove_cgroups([child for cgroup in cgroups for child in cgroup.iterdir() if child.is_dir()])
        for cgroup in cgroups:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        for namespace in Path("/run/netns").glob(f"{hub}*"):
            subprocess.run(["ip", "netns", "delete", namespace.name], check=False, capture_output=True)
    return sorted(hubs)
