"""The GPU nodes' NVMe scratch volume (dtrain/remote/boot/nvme-raid.sh, nvme-raid.service).

Two ways in here: the rendered script against stub commands (the RAID 0 decisions over eight disks
found by their model), and the real script on a loop device, formatted and mounted for real, through
re-runs, reboots and a deallocation (the disk wiped). The third, the real script in a virtual machine
with four NVMe disks, where the kernel's md driver builds the RAID 0 that a container cannot, is
tests/boot/test_nvme_raid_vm.py: opt-in (`make test-boot-vm`), as QEMU only emulates here (six
minutes of a core).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.cloud_init._common import render_script
from infra.contract import NVME_MOUNT_PATH
from infra.skus import GPU_SKUS
from tests.infra.documents import SKUS, files_of, node_doc, script_of, setup_packages
from tests.infra.nvme_vm import REPO
from tests.infra.sandbox import Sandbox, shell_value, tool, with_value
from tests.polling import wait_for

NVME_RAID = "/usr/local/sbin/nvme-raid"
UNIT = "/etc/systemd/system/nvme-raid.service"
LOCAL_DISKS = [f"/dev/nvme{index}n1" for index in range(8)]
ARRAY_UUID = "0a1b2c3d:4e5f6a7b:8c9d0e1f:2a3b4c5d"


# --- what the nodes get ---------------------------------------------------------------------


@pytest.mark.parametrize("sku", SKUS)
def test_node_builds_the_sizes_nvme_disks_at_its_mount(sku: str) -> None:
    script = script_of(node_doc(sku), NVME_RAID)
    expected = GPU_SKUS[sku].nvme_disks
    assert shell_value(script, "EXPECTED_DISKS") == str(expected or 0)
    assert shell_value(script, "MOUNT_PATH") == GPU_SKUS[sku].nvme_mount == NVME_MOUNT_PATH


def test_confirmed_sizes_have_eight_nvme_disks() -> None:
    assert GPU_SKUS["Standard_ND96isr_H100_v5"].nvme_disks == 8
    assert GPU_SKUS["Standard_ND96isr_H200_v5"].nvme_disks == 8


def test_volume_is_built_at_every_boot_before_slurmd() -> None:
    document = node_doc()
    files = files_of(document)
    unit = files[UNIT]["content"]
    assert re.search(r"^Before=slurmd\.service$", unit, re.MULTILINE)
    assert re.search(rf"^ExecStart={NVME_RAID}$", unit, re.MULTILINE)
    assert "WantedBy=multi-user.target" in unit  # enabled: runs again after a deallocate/start
    setup = files["/usr/local/sbin/node-setup"]["content"]
    assert setup.index("systemctl enable --now nvme-raid.service") < setup.index("step slurmd slurmd-setup")
    assert {"mdadm", "xfsprogs"} <= set(setup_packages(document))


@pytest.mark.parametrize(
    ("overrides", "key"), [({"nvme_disks": 0}, "nvme_disks"), ({"nvme_mount": "nvme"}, "nvme_mount")]
)
def test_node_rejects_bad_nvme_input(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        node_doc(**overrides)


# --- the RAID 0 decisions, against stub commands ------------------------------------------


def stubbed(sandbox: Sandbox, expected: int = 8) -> str:
    """The node's script with its mount point and device paths in the sandbox, and stateful stubs
    for lsblk (eight local disks among others), mdadm, blkid, mkfs.xfs and mount."""
    script = with_value(script_of(node_doc(), NVME_RAID), "MOUNT_PATH", str(sandbox.root / "nvme"))
    script = with_value(script, "EXPECTED_DISKS", expected)
    script = with_value(script, "MD_UUID_LINK_PREFIX", f"{sandbox.root}/by-id/md-uuid-")
    script = with_value(script, "MD_DEVICE", f"{sandbox.root}/md-nvme")
    script = with_value(script, "DISK_WAIT_SECONDS", 0)
    (sandbox.root / "by-id").mkdir()
    disks = "".join(f"{disk} Microsoft NVMe Direct Disk              \\n" for disk in LOCAL_DISKS[:expected])
    sandbox.stub("lsblk", f'printf "/dev/sda Virtual Disk\\n{disks}/dev/nvme9n1 MSFT NVMe Accelerator v1.0\\n"')
    sandbox.stub(
        "mdadm",
        f"""state=$STUB_STATE
case "$1" in
  --examine) [ -f "$state/md_uuid" ] || exit 1; echo "MD_UUID=$(cat "$state/md_uuid")" ;;
  --create)
    for arg in "$@"; do case $arg in --raid-devices=*) echo "${{arg#*=}}" >"$state/md_devices" ;; esac; done
    echo {ARRAY_UUID} >"$state/md_uuid"; touch "$2" ;;
  --assemble) touch "$2" ;;
  --detail) echo MD_LEVEL=raid0; echo "MD_DEVICES=$(cat "$state/md_devices")" ;;
esac""",
    )
    sandbox.stub("blkid", '[ -f "$STUB_STATE/formatted" ] || exit 2; echo xfs')
    sandbox.stub("mkfs.xfs", 'touch "$STUB_STATE/formatted"')
    sandbox.stub("mountpoint", '[ -f "$STUB_STATE/mounted" ]')
    sandbox.stub("mount", 'touch "$STUB_STATE/mounted"')
    sandbox.stub("udevadm")
    return script


def boot(sandbox: Sandbox, *, assembled_by_udev: bool = False) -> None:
    """A reboot: nothing mounted, no array running (or one that udev assembled and linked)."""
    (sandbox.state / "mounted").unlink(missing_ok=True)
    (sandbox.root / "md-nvme").unlink(missing_ok=True)
    link = sandbox.root / "by-id" / f"md-uuid-{ARRAY_UUID}"
    link.unlink(missing_ok=True)
    if assembled_by_udev:
        link.touch()


def deallocate(sandbox: Sandbox) -> None:
    """Azure gives the disks back empty: no md superblock, no file system."""
    boot(sandbox)
    for leftover in ("md_uuid", "md_devices", "formatted"):
        (sandbox.state / leftover).unlink(missing_ok=True)


def test_builds_raid0_over_exactly_the_local_nvme_disks_formats_and_mounts(sandbox: Sandbox) -> None:
    result = sandbox.run(stubbed(sandbox))
    assert result.returncode == 0, result.stderr
    assert [call for call in sandbox.calls("mdadm") if "--create" in call] == [
        f"mdadm --create {sandbox.root}/md-nvme --name=nvme --level=0 --raid-devices=8 --run " + " ".join(LOCAL_DISKS)
    ]
    assert sandbox.calls("mkfs.xfs") == [f"mkfs.xfs -K {sandbox.root}/md-nvme"]
    assert sandbox.calls("mount") == [f"mount -o noatime {sandbox.root}/md-nvme {sandbox.root}/nvme"]
    assert (sandbox.root / "nvme").stat().st_mode & 0o7777 == 0o1777


def test_run_again_reboot_and_deallocation(sandbox: Sandbox) -> None:
    script = stubbed(sandbox)
    for _ in range(2):  # the second run finds it mounted and changes nothing
        assert sandbox.run(script).returncode == 0
    assert len(sandbox.calls("mount")) == 1
    boot(sandbox, assembled_by_udev=True)
    assert sandbox.run(script).returncode == 0
    boot(sandbox)  # the array not assembled yet
    assert sandbox.run(script).returncode == 0
    mdadm = sandbox.calls("mdadm")
    assert len([call for call in mdadm if "--create" in call]) == 1
    assert [call for call in mdadm if "--assemble" in call] == [
        f"mdadm --assemble {sandbox.root}/md-nvme --uuid={ARRAY_UUID} " + " ".join(LOCAL_DISKS)
    ]
    assert (
        sandbox.calls("mount")[1] == f"mount -o noatime {sandbox.root}/by-id/md-uuid-{ARRAY_UUID} {sandbox.root}/nvme"
    )
    assert len(sandbox.calls("mkfs.xfs")) == 1

    deallocate(sandbox)
    result = sandbox.run(script)
    assert result.returncode == 0, result.stderr
    assert len([call for call in sandbox.calls("mdadm") if "--create" in call]) == 2
    assert len(sandbox.calls("mkfs.xfs")) == 2


def test_missing_disks_fail_instead_of_building_a_smaller_array(sandbox: Sandbox) -> None:
    script = stubbed(sandbox, expected=8)
    script = with_value(script, "EXPECTED_DISKS", 9)
    result = sandbox.run(script)
    assert result.returncode != 0
    assert "found 8 local NVMe disks" in result.stderr
    assert not [call for call in sandbox.calls("mdadm") if "--create" in call]


def test_an_array_of_other_disks_is_refused(sandbox: Sandbox) -> None:
    script = stubbed(sandbox)
    (sandbox.state / "md_uuid").write_text(f"{ARRAY_UUID}\n")
    (sandbox.state / "md_devices").write_text("4\n")
    result = sandbox.run(script)
    assert result.returncode != 0
    assert "refusing to guess" in result.stderr
    assert not sandbox.calls("mkfs.xfs")


# --- the real script on loop devices --------------------------------------------------------

LOOP_TOOLS = ("losetup", "mkfs.xfs", "wipefs", "mount", "umount", "blkid", "mdadm")


def loop_devices_usable() -> str | None:
    """Why the real-device test cannot run here; None when it can."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [name for name in LOOP_TOOLS if shutil.which(name) is None]
    if missing:
        return f"needs {', '.join(missing)}: run make setup (tools/setup_system.sh installs mdadm and xfsprogs)"
    if not Path("/dev/loop-control").exists():
        return "needs loop devices (/dev/loop-control)"
    return None


@pytest.fixture
def loops(tmp_path: Path) -> Iterator[list[str]]:
    """A loop device over a sparse file (XFS wants 300 MB at least); detached afterwards."""
    problem = loop_devices_usable()
    assert problem is None, problem
    devices: list[str] = []
    try:
        for index in range(1):
            backing = tmp_path / f"disk{index}.img"
            with backing.open("wb") as file:
                file.truncate(512 * 1024 * 1024)
            found = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True)
            assert found.returncode == 0, found.stderr
            devices.append(found.stdout.strip())
        yield devices
    finally:
        subprocess.run(["mdadm", "--stop", "/dev/md/nvme"], capture_output=True, check=False)
        for device in devices:
            subprocess.run(["losetup", "--detach", device], capture_output=True, check=False)


def real_script(mount: Path) -> Path:
    path = mount.parent / "nvme-raid"
    path.write_text(render_script("boot/nvme-raid.sh", {"MOUNT_PATH": str(mount), "EXPECTED_DISKS": 0}))
    return path


class MountNamespace:
    """A mount namespace of the test's own, where the volume is mounted and unmounted. On the host, a mount
    namespace made while the volume is mounted (the local cluster's nodes and sshd, started by another
    worker of the suite) keeps a private copy of the mount after the host unmounts it: the filesystem
    stays busy, and a wipe or a detach fails ('Device or resource busy')."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "infinity"])
        self.enter = ["nsenter", f"--target={self.holder.pid}", "--mount"]
        # unshare has made the namespace once its child, sleep, runs in it
        same = os.readlink("/proc/self/ns/mnt")
        wait_for(lambda: os.readlink(f"/proc/{self.holder.pid}/ns/mnt") != same, 30, "unshare to make the namespace")

    def run(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.enter, *argv], capture_output=True, text=True, timeout=120, check=check)

    def path(self, path: Path) -> Path:
        """path as the namespace sees it (its root, through /proc)."""
        return Path(f"/proc/{self.holder.pid}/root") / path.relative_to("/")

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


@pytest.fixture
def namespace() -> Iterator[MountNamespace]:
    made = MountNamespace()
    try:
        yield made
    finally:
        made.close()


def mounted_fs_type(namespace: MountNamespace, mount: Path) -> str:
    return namespace.run("findmnt", "--noheadings", "--output", "FSTYPE", "--mountpoint", str(mount)).stdout.strip()


def check_volume_lifecycle(
    namespace: MountNamespace, script: Path, mount: Path, devices: list[str], wipe: list[str]
) -> None:
    """Build, run again, reboot (not mounted), deallocate (wipe): what a node's volume goes through."""
    kept = namespace.path(mount / "kept")
    try:
        result = namespace.run("bash", str(script), *devices)
        assert result.returncode == 0, result.stderr
        assert mounted_fs_type(namespace, mount) == "xfs"
        kept.write_text("survives a re-run and a reboot")

        result = namespace.run("bash", str(script), *devices)  # run again: nothing changes
        assert result.returncode == 0 and "already mounted" in result.stderr, result.stderr
        namespace.run("umount", str(mount), check=True)  # a reboot: the volume is there, not mounted
        result = namespace.run("bash", str(script), *devices)
        assert result.returncode == 0, result.stderr
        assert "formatting" not in result.stderr
        assert kept.read_text() == "survives a re-run and a reboot"

        namespace.run("umount", str(mount), check=True)  # deallocate: Azure hands back empty disks
        namespace.run("mdadm", "--stop", "/dev/md/nvme")
        for device in wipe:
            namespace.run("wipefs", "--all", "--quiet", device, check=True)
        result = namespace.run("bash", str(script), *devices)
        assert result.returncode == 0, result.stderr
        assert "formatting" in result.stderr
        assert mounted_fs_type(namespace, mount) == "xfs"
        assert not kept.exists()
    finally:
        namespace.run("umount", str(mount))


def test_single_disk_is_formatted_mounted_kept_and_rebuilt_after_a_wipe(
    tmp_path: Path, loops: list[str], namespace: MountNamespace
) -> None:
    mount = tmp_path / "nvme"
    check_volume_lifecycle(namespace, real_script(mount), mount, loops[:1], wipe=loops[:1])


# --- the scripts of the VM test (tests/boot/test_nvme_raid_vm.py, opt-in) -----------------------


@pytest.mark.parametrize("script", ["tests/infra/vm_init.sh", "tools/fetch_vm_kernel.sh"])
def test_the_vm_scripts_pass_shellcheck(script: str) -> None:
    command = [tool("shellcheck"), "--severity=style", str(REPO / script)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
