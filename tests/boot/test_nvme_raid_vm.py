"""The GPU nodes' NVMe scratch volume in a virtual machine with four NVMe disks (tests/infra/nvme_vm.py):
the kernel's md driver builds the RAID 0 that a container cannot (no /proc/mdstat), udev assembles it
at boot, and the disks come back empty after a deallocation. The script's decisions and its file system
lifecycle on a real device are tests/infra/test_nvme_raid.py, in `make test`.

Opt-in, with the VM boot test (`make test-boot-vm` sets DTRAIN_BOOT_VM=1): under software emulation,
four boots take about six minutes of a core, which `make test` cannot spare.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from infra.cloud_init._common import render_script
from tests.infra.nvme_vm import DISK_MODEL, NvmeVm

pytestmark = pytest.mark.skipif(
    os.environ.get("DTRAIN_BOOT_VM") != "1" or os.geteuid() != 0,
    reason="the NVMe VM test runs with `make test-boot-vm` (DTRAIN_BOOT_VM=1), as root",
)

VM_MOUNT = "/tmp/nvme"  # the VM's root is this machine's, read-only; its /tmp is a tmpfs
VM_DISKS = 4
START_UDEV = "/lib/systemd/systemd-udevd --daemon && udevadm trigger --action=add && udevadm settle\n"
# After the node's script: what the volume is, what the last boot left on it, a clean shutdown.
REPORT_AND_SHUT_DOWN = f"""
mdadm --detail --export "$(findmnt --noheadings --output SOURCE {VM_MOUNT})" > array.txt
findmnt --noheadings --output FSTYPE {VM_MOUNT} > fstype.txt
cat {VM_MOUNT}/kept > kept.txt 2>/dev/null || : > kept.txt
echo "$BOOT" > {VM_MOUNT}/kept
umount {VM_MOUNT}
"""


def vm_script(work: Path) -> None:
    """The node's script for a VM: its mount point in the VM's tmpfs, four disks expected, and
    QEMU's disk model in place of Azure's, so that it finds the disks by model as on a node."""
    script = render_script("boot/nvme-raid.sh", {"MOUNT_PATH": VM_MOUNT, "EXPECTED_DISKS": VM_DISKS})
    azure_model = "readonly LOCAL_NVME_MODEL='^Microsoft NVMe Direct Disk( v2)?$'"
    assert azure_model in script
    (work / "nvme-raid").write_text(script.replace(azure_model, f"readonly LOCAL_NVME_MODEL='^{DISK_MODEL}$'"))


def boot_node(vm: NvmeVm, name: str, *, udev: bool = True) -> tuple[str, dict[str, str]]:
    """One boot: udev (or not), the script twice, the report. Returns the first run's log and the report."""
    runs = "bash nvme-raid 2> first.log || exit $?\nbash nvme-raid 2> second.log || exit $?\n"
    boot = vm.boot(f"BOOT={name}\n{START_UDEV if udev else ''}{runs}{REPORT_AND_SHUT_DOWN}")
    first = (vm.work / "first.log").read_text() if (vm.work / "first.log").exists() else ""
    assert boot.rc == 0, f"{name}: rc {boot.rc}\n{first}\n{boot.log}\n{boot.console[-3000:]}"
    assert "is already mounted" in (vm.work / "second.log").read_text()  # a second run changes nothing
    array = dict(line.split("=", 1) for line in (vm.work / "array.txt").read_text().split())
    report = {
        "level": array["MD_LEVEL"],
        "members": array["MD_DEVICES"],
        "fstype": (vm.work / "fstype.txt").read_text().strip(),
        "kept": (vm.work / "kept.txt").read_text().strip(),
    }
    return first, report


def test_raid0_over_four_nvme_disks_through_reboots_and_a_deallocation(tmp_path: Path) -> None:
    vm = NvmeVm(tmp_path, disks=VM_DISKS)
    vm_script(tmp_path)
    volume = {"level": "raid0", "members": str(VM_DISKS), "fstype": "xfs"}

    log, report = boot_node(vm, "first-boot")
    assert re.search(r"creating RAID 0 over( /dev/nvme\dn1){4}$", log, re.MULTILINE), log
    assert "formatting" in log
    assert report == {**volume, "kept": ""}

    log, report = boot_node(vm, "reboot-udev")  # udev assembled the array at boot
    assert "keeping the existing XFS file system on /dev/disk/by-id/md-uuid-" in log, log
    assert "creating" not in log and "assembling" not in log
    assert report == {**volume, "kept": "first-boot"}

    log, report = boot_node(vm, "reboot-no-udev", udev=False)  # nothing assembled it: the script does
    assert "assembling the existing array" in log and "formatting" not in log, log
    assert report == {**volume, "kept": "reboot-udev"}

    vm.deallocate()
    log, report = boot_node(vm, "after-deallocation")
    assert "creating RAID 0" in log and "formatting" in log, log
    assert report == {**volume, "kept": ""}
