"""cloud-config for the NFS file server (Ubuntu 22.04)."""

from __future__ import annotations

import posixpath

from infra.cloud_init._common import (
    check_cidr,
    check_int,
    check_path,
    cloud_config,
    render_script,
    write_file,
)
from infra.cloud_init.users import HostUsers, users_commands, users_files
from infra.users import APPLIED_DIR, HOMES_DIR, LIST_FILE, USERS_DIR

# Azure links data disk N to /dev/disk/azure/scsi1/lunN: stable, unlike /dev/sdX.
LUN_DIR = "/dev/disk/azure/scsi1"
# Azure allows LUNs 0-63.
MAX_DATA_DISKS = 64
BLOB_PULL_PATH = "/usr/local/bin/blob-pull"
SETUP_PATH = "/usr/local/sbin/nfs-data-setup"
# no_root_squash: root on the head node sets up runs/, root on the nodes writes the health reports
# (.health/), and the training containers run as root and write their run directories. Squashing
# would add no trust boundary: only the cluster subnet may mount, and whoever is root on a node is
# the operator, who already is root on this server.
EXPORT_OPTIONS = "rw,sync,no_subtree_check,no_root_squash"


def render_nfs_server(*, data_disk_count: int, export_path: str, allowed_cidr: str, blob_pull_script: str) -> str:
    """cloud-config that stripes the data disks, exports export_path to allowed_cidr only, and
    installs blob_pull_script as /usr/local/bin/blob-pull."""
    count = check_int("data_disk_count", data_disk_count, 1, MAX_DATA_DISKS)
    path = check_path("export_path", export_path)
    cidr = check_cidr("allowed_cidr", allowed_cidr)
    if not isinstance(blob_pull_script, str) or not blob_pull_script.startswith("#!"):
        raise ValueError("blob_pull_script must be the script's text, starting with a #! line")

    setup = render_script(
        "boot/nfs-data-setup.sh",
        {
            "DATA_DISKS": [f"{LUN_DIR}/lun{lun}" for lun in range(count)],
            "EXPORT_PATH": path,
            "EXPORT_LINE": f"{path} {cidr}({EXPORT_OPTIONS})",
        },
    )
    return cloud_config(
        {
            "package_update": True,
            "packages": ["nfs-kernel-server", "mdadm", "xfsprogs", "python3"],
            "write_files": [
                write_file(BLOB_PULL_PATH, blob_pull_script, "0755"),
                write_file(SETUP_PATH, setup, "0755"),
                # Never serve the bare mount point: nfs-server starts only with the volume mounted.
                write_file(
                    "/etc/systemd/system/nfs-server.service.d/10-require-export.conf",
                    f"[Unit]\nRequiresMountsFor={path}\n",
                    "0644",
                ),
                # the people stage datasets here as themselves: their accounts, homes in the export's home/
                *users_files(_exported_users(path)),
            ],
            "runcmd": [[SETUP_PATH], *users_commands()],
        }
    )


def _exported_users(export_path: str) -> HostUsers:
    """How the NFS server applies the users list: the export's own (what the hosts mount as .users)."""
    users = posixpath.join(export_path, USERS_DIR)
    return HostUsers(
        list_path=posixpath.join(users, LIST_FILE),
        home_root=posixpath.join(export_path, HOMES_DIR),
        report_dir=posixpath.join(users, APPLIED_DIR),
    )
