"""The boot test's virtual machines and their network (runs on the host, as root).

Everything lives in a network namespace of its own, made for one test run and deleted after it: a
bridge with the host's address on the VMs' network (and Azure's IMDS address, 169.254.169.254), one
tap per VM, the QEMU processes. The host's own network is never touched. The VMs are QEMU
machines with 1 vCPU, booted from a copy-on-write overlay of the cached image
(tools/build_boot_image.sh) with Debian's kernel and initrd from that image, a NoCloud seed
(tests/boot/seed.py), and the disks Azure would give them: SCSI data disks at LUNs 0..N-1 (the NFS
server), local NVMe disks (GPU nodes; emptied by each deallocation, as Azure's are).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

QEMU = "qemu-system-x86_64"
BRIDGE = "br0"
CLONE_NEWNET = 0x40000000
NVME_DISK_MIB = 64
DATA_DISK_MIB = 256
STOP_WAIT_S = 10
# On this kind of machine /dev/kvm opens, but a Linux guest hangs under it as it leaves real mode
# (SeaBIOS runs; the kernel never prints): software emulation is the default that works.
# DTRAIN_BOOT_ACCEL=kvm where KVM boots Linux.
ACCEL = os.environ.get("DTRAIN_BOOT_ACCEL", "tcg")


class Namespace:
    """A network namespace with a bridge at host_address/prefix and IMDS's address on it."""

    def __init__(self, name: str, host_address: str, prefixlen: int, imds_address: str) -> None:
        self.name = name
        subprocess.run(["ip", "netns", "add", name], check=True)
        for command in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "addr", "add", f"{host_address}/{prefixlen}", "dev", BRIDGE],
            ["ip", "addr", "add", f"{imds_address}/32", "dev", BRIDGE],
            ["ip", "link", "set", BRIDGE, "up"],
        ):
            self.run(command)

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        """argv inside the namespace; raises on failure unless check=False is passed."""
        options: dict[str, object] = {"check": True, "capture_output": True, "text": True, **kwargs}
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], **options)  # type: ignore[call-overload]

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)  # type: ignore[call-overload]

    @contextmanager
    def entered(self) -> Iterator[None]:
        """This thread inside the namespace: sockets made here (the endpoint servers) stay there."""
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the boot test's namespace")
            try:
                yield
            finally:
                if libc.setns(home, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the host's namespace")
        finally:
            os.close(home)
            os.close(target)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], check=False, capture_output=True)


@dataclass
class VmSpec:
    name: str  # the machine's name in the test (its hostname may differ in case)
    address: str
    mac: str
    memory_mib: int = 1024
    gpus: int = 0  # emulated /dev/nvidia* (tools/boot_image/rootfs/usr/local/sbin/boot-hardware)
    infiniband_ports: int = 0  # emulated InfiniBand ports, ACTIVE at infiniband_rate_gbps
    infiniband_rate_gbps: int = 0
    nvme_disks: int = 0
    data_disks: int = 0


@dataclass
class Vm:
    spec: VmSpec
    image: Path  # tools/build_boot_image.sh's output: rootfs.img, vmlinuz, initrd.img
    work: Path
    seed: Path
    namespace: Namespace
    tap: str
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    boots: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.overlay = self.work / "disk.qcow2"
        subprocess.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-F",
                "raw",
                "-b",
                str(self.image / "rootfs.img"),
                str(self.overlay),
            ],
            check=True,
        )
        self.data_disks = [self.work / f"data{lun}.img" for lun in range(self.spec.data_disks)]
        self.nvme_disks = [self.work / f"nvme{index}.img" for index in range(self.spec.nvme_disks)]
        for disk in self.data_disks:
            disk.write_bytes(b"")
            os.truncate(disk, DATA_DISK_MIB * 1024 * 1024)
        self.namespace.run(["ip", "tuntap", "add", "dev", self.tap, "mode", "tap"])
        self.namespace.run(["ip", "link", "set", self.tap, "master", BRIDGE, "up"])

    @property
    def console(self) -> Path:
        return self.work / f"console-{self.boots}.log"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Power on (Azure's start): the OS disk as it was left, the NVMe disks empty."""
        if self.running():
            return
        for disk in self.nvme_disks:
            with disk.open("wb") as file:
                file.truncate(NVME_DISK_MIB * 1024 * 1024)
        self.boots += 1
        spec = self.spec
        append = (f"root=/dev/vda rw console=ttyS0 net.ifnames=0 boot.gpus={spec.gpus} "
                  f"boot.ib={spec.infiniband_ports} boot.ib_rate={spec.infiniband_rate_gbps}")  # fmt: skip
        command = [
            QEMU, "-machine", f"q35,accel={ACCEL}", "-cpu", "host" if ACCEL == "kvm" else "max",
            "-smp", "1", "-m", str(spec.memory_mib),
            "-display", "none", "-monitor", "none", "-serial", f"file:{self.console}", "-no-reboot",
            "-kernel", str(self.image / "vmlinuz"), "-initrd", str(self.image / "initrd.img"), "-append", append,
            "-drive", f"file={self.overlay},if=virtio,format=qcow2,cache=unsafe",
            "-drive", f"file={self.seed},if=virtio,format=raw,readonly=on",
            "-netdev", f"tap,id=net0,ifname={self.tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=net0,mac={spec.mac}",
        ]  # fmt: skip
        if self.data_disks:
            command += ["-device", "virtio-scsi-pci,id=scsi1"]
        for lun, disk in enumerate(self.data_disks):
            command += ["-drive", f"file={disk},if=none,id=data{lun},format=raw,cache=unsafe"]
            command += ["-device", f"scsi-hd,drive=data{lun},bus=scsi1.0,channel=0,scsi-id=0,lun={lun}"]
        for index, disk in enumerate(self.nvme_disks):
            command += ["-drive", f"file={disk},if=none,id=nvme{index},format=raw,cache=unsafe"]
            command += ["-device", f"nvme,serial=nvme{index},drive=nvme{index}"]
        log = (self.work / "qemu.log").open("ab")
        self.process = self.namespace.popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def request_start(self) -> None:
        """ARM's start call."""
        self.start()

    def stop(self) -> None:
        """Power off at once (Azure's deallocate): QEMU ends; the OS disk stays."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def wait_stopped(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.5)
        return not self.running()
