"""The shared file system as the hosts' cloud-config installs it: the NFS server's export, or Azure
Managed Lustre (sharedStorage, infra/config.py).

Each kind is one boot step (node-setup's and head-setup's), with the same bounded retries: a program
named after the step that adds the fstab entry and waits for the mount (dtrain/remote/boot/nfs-mount.sh,
lustre-mount.sh). Lustre adds, on the nodes, the program that stops the writers on the mount, flushes
and unmounts it before the VM goes (dtrain/remote/boot/shared_release.py), and has the Spot agent run it
(on an eviction, and when the head node's power program asks before a deallocation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.cloud_init._common import check_ipv4, check_path, remote_file, render_script, write_file
from infra.cloud_init.nfs_server import BLOB_PULL_PATH

SBIN = "/usr/local/sbin"
# Everything on the nodes runs it as this path: the Spot agent, and an operator by hand.
SHARED_RELEASE_PATH = f"{SBIN}/shared-release"
SPOT_AGENT_RELEASE_DROP_IN = "/etc/systemd/system/spot-agent.service.d/shared-release.conf"
LUSTRE_FS_NAME = "lustrefs"  # Azure Managed Lustre's name for every file system


@dataclass(frozen=True)
class NfsShare:
    """The NFS server's export (infra/nfs.py)."""

    server_ip: str
    export_path: str


@dataclass(frozen=True)
class LustreShare:
    """An Azure Managed Lustre file system (infra/lustre.py), by its management service's address.
    data_at_root: the `data` container is imported at its root (lustreImportData), where the datasets then
    are; otherwise they go to a data directory beneath the mount, as on NFS."""

    mgs_address: str
    data_at_root: bool = False


SharedFileSystem = NfsShare | LustreShare


@dataclass(frozen=True)
class SharedMount:
    """How a host mounts the shared file system: its boot step (named after the program that runs it, on
    root's PATH), and the files that the cloud-config writes for it."""

    step: str
    mount_path: str
    files: list[dict[str, Any]]

    @property
    def program(self) -> str:
        return f"{SBIN}/{self.step}"


def shared_mount(shared: SharedFileSystem, mount_path: str) -> SharedMount:
    """The mount program of either kind, with its checked source."""
    mount = check_path("mount_path", mount_path)
    if isinstance(shared, NfsShare):
        source = f"{check_ipv4('nfs_server_ip', shared.server_ip)}:{check_path('nfs_export_path', shared.export_path)}"
        step, template = "nfs-mount", "boot/nfs-mount.sh"
    elif isinstance(shared, LustreShare):
        source = f"{check_ipv4('lustre_mgs_address', shared.mgs_address)}@tcp:/{LUSTRE_FS_NAME}"
        step, template = "lustre-mount", "boot/lustre-mount.sh"
    else:
        raise ValueError(f"shared: {shared!r} is neither an NfsShare nor a LustreShare")
    script = render_script(template, {"SOURCE": source, "MOUNT_PATH": mount})
    return SharedMount(step, mount, [write_file(f"{SBIN}/{step}", script, "0755")])


def release_files(shared: SharedFileSystem, mount_path: str) -> list[dict[str, Any]]:
    """Lustre on a node: the release program, and the Spot agent's drop-in that hands it the mount. Azure's
    guidance is that a Lustre client unmounts before it shuts down; NFS needs none of it."""
    if not isinstance(shared, LustreShare):
        return []
    mount = check_path("mount_path", mount_path)
    drop_in = (
        "[Service]\n"
        "# sharedStorage lustre: before the node goes (an eviction, a suspend), stop the writers on the mount,\n"
        "# flush it and unmount it (dtrain/remote/boot/shared_release.py)\n"
        "ExecStart=\n"
        f"ExecStart=/usr/bin/python3 {SBIN}/spot-agent --node %H --release-program {SHARED_RELEASE_PATH} "
        f"--release-mount {mount}\n"
    )
    return [
        write_file(SHARED_RELEASE_PATH, remote_file("boot/shared_release.py"), "0755"),
        write_file(SPOT_AGENT_RELEASE_DROP_IN, drop_in, "0644"),
    ]


def lustre_head_files(shared: SharedFileSystem) -> list[dict[str, Any]]:
    """Lustre on the head node: blob-pull (at the NFS server's path), with which `stage` fills the file system;
    on NFS the server has it."""
    if not isinstance(shared, LustreShare):
        return []
    return [write_file(BLOB_PULL_PATH, remote_file("boot/blob_pull.py"), "0755")]


def data_dir(shared: SharedFileSystem, data_path: str) -> str:
    """The data directory the head node makes on the shared file system: none on NFS (its server makes it)
    nor where Lustre imports the datasets at its root."""
    if isinstance(shared, LustreShare) and not shared.data_at_root:
        return check_path("data_path", data_path)
    return ""
