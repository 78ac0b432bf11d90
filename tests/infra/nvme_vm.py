"""A throwaway QEMU virtual machine with NVMe disks, for what needs a kernel of its own.

Containers share the host's kernel and often lack its md driver (no /proc/mdstat), so RAID 0 cannot
be built in one. This VM boots Debian's kernel (tools/fetch_vm_kernel.sh caches it) with a
busybox initramfs (tests/infra/vm_init.sh), takes this machine's root read-only over 9p as its
own, and runs one shell script per boot. Its disks are QEMU's emulated NVMe controllers over sparse
files that outlive the VM, so a test can reboot a node, or wipe its disks as a deallocation does.
TCG (software emulation): it needs no /dev/kvm, and a boot takes about 10 seconds.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nvme-vm"
QEMU = "qemu-system-x86_64"
BUSYBOX = "/bin/busybox"  # static (busybox-static): the initramfs has no libraries
# The drivers the VM loads, with what they need: NVMe disks, md RAID 0, XFS, the 9p root.
MODULES = ("nvme", "raid0", "xfs", "9p", "9pnet_virtio", "virtio_pci")
DISK_MODEL = "QEMU NVMe Ctrl"  # QEMU 7.2's NVMe model number; it cannot be set before QEMU 8
BOOT_TIMEOUT = 180  # seconds; a boot and its script take about 10 on 2 shared cores


def missing_tools() -> list[str]:
    """What a VM needs that this machine lacks, each with how to get it."""
    problems = [f"{tool} (make setup)" for tool in (QEMU, "modprobe") if shutil.which(tool) is None]
    if not Path(BUSYBOX).exists():
        problems.append(f"{BUSYBOX} (make setup: busybox-static)")
    if not Path("/lib/systemd/systemd-udevd").exists():
        problems.append("systemd-udevd (make setup: udev)")
    if kernel_root() is None:
        problems.append(f"a kernel under {KERNEL_CACHE} (make setup: tools/fetch_vm_kernel.sh)")
    return problems


def kernel_root() -> Path | None:
    """The unpacked kernel package: ``boot/vmlinuz-<version>`` and ``lib/modules/<version>``."""
    complete = sorted(KERNEL_CACHE.glob("*/.complete"))
    return complete[-1].parent if complete else None


@dataclass
class Boot:
    rc: int | None  # the boot script's exit status; None when the VM died before it finished
    log: str  # the boot script's output
    console: str  # QEMU's and the kernel's


class NvmeVm:
    """A VM with ``disks`` NVMe disks of ``disk_mib`` MiB each, its files under ``work``."""

    def __init__(self, work: Path, disks: int, disk_mib: int = 512) -> None:
        problems = missing_tools()
        assert not problems, f"the NVMe VM needs: {', '.join(problems)}"
        root = kernel_root()
        assert root is not None
        self.kernel = next((root / "boot").glob("vmlinuz-*"))
        self.work = work
        self.disks = [work / f"nvme{index}.img" for index in range(disks)]
        self.disk_mib = disk_mib
        self.initramfs = build_initramfs(root, work / "initramfs")
        self.deallocate()

    def deallocate(self) -> None:
        """Azure's deallocation: the local disks come back empty."""
        for disk in self.disks:
            with disk.open("wb") as file:
                file.truncate(self.disk_mib * 1024 * 1024)

    def boot(self, script: str) -> Boot:
        """Boot, run ``script`` (bash, as root, in the work directory) and power off."""
        (self.work / "boot.sh").write_text(f"cd {self.work}\n{script}")
        (self.work / "rc").unlink(missing_ok=True)
        # cache=unsafe: without it, XFS's log writes on the md array timed out in QEMU's NVMe
        # emulation under TCG. Unsafe only for a host crash, which would end the test anyway.
        drives = []
        for index, disk in enumerate(self.disks):
            drives += [
                "-drive",
                f"file={disk},if=none,id=disk{index},format=raw,cache=unsafe,aio=threads",
                "-device",
                f"nvme,serial=disk{index},drive=disk{index}",
            ]
        command = [
            QEMU,
            "-machine", "accel=tcg", "-cpu", "max", "-m", "1024", "-smp", "1",
            "-nographic", "-no-reboot",
            "-kernel", str(self.kernel), "-initrd", str(self.initramfs),
            "-append", f"console=ttyS0 quiet loglevel=1 panic=-1 vm.work={self.work}",
            "-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={self.work},mount_tag=work,security_model=none",
            *drives,
        ]  # fmt: skip
        console = subprocess.run(
            command, capture_output=True, text=True, errors="replace", timeout=BOOT_TIMEOUT, check=False
        )
        rc_file, log_file = self.work / "rc", self.work / "boot.log"
        return Boot(
            int(rc_file.read_text()) if rc_file.exists() else None,
            log_file.read_text() if log_file.exists() else "",
            console.stdout + console.stderr,
        )


def build_initramfs(kernel_root: Path, staging: Path) -> Path:
    """busybox, the modules in load order and vm_init.sh as /init, in a gzipped newc cpio."""
    version = next((kernel_root / "lib" / "modules").iterdir()).name
    for directory in ("bin", "dev", "proc", "sys", "host", "modules"):
        (staging / directory).mkdir(parents=True, exist_ok=True)
    shutil.copy(BUSYBOX, staging / "bin" / "busybox")
    shutil.copy(REPO / "tests" / "infra" / "vm_init.sh", staging / "init")
    (staging / "init").chmod(0o755)
    order: list[str] = []
    for module in MODULES:
        plan = subprocess.run(
            ["modprobe", "--dirname", str(kernel_root), "--set-version", version, "--show-depends", module],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in plan.splitlines():  # "insmod /path/to/module.ko " for each, dependencies first
            path = Path(line.split()[1])
            if path.name not in order:
                order.append(path.name)
                shutil.copy(path, staging / "modules" / path.name)
    (staging / "modules" / "order").write_text("\n".join(order) + "\n")
    names = subprocess.run(["find", "."], cwd=staging, capture_output=True, text=True, check=True).stdout
    archive = subprocess.run(
        [BUSYBOX, "cpio", "-o", "-H", "newc"], cwd=staging, input=names.encode(), capture_output=True, check=True
    ).stdout
    initramfs = staging.with_suffix(".gz")
    initramfs.write_bytes(gzip.compress(archive, compresslevel=1))
    return initramfs
