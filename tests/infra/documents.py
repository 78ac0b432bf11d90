"""The cloud-init documents under test, rendered with stand-in values, and ways to look inside them."""

from __future__ import annotations

import base64
import gzip
import shlex

import yaml

from infra.cloud_init import (
    render_cgroup_conf,
    render_cluster_node,
    render_gres_conf,
    render_head_node,
    render_nfs_server,
    render_slurm_conf,
)
from infra.cloud_init.accounting import AZURE_MYSQL_CA_BUNDLE, LOOPBACK, AccountingDatabase, HeadAccounting
from infra.cloud_init.shared_storage import LustreShare, NfsShare
from infra.cloud_init.slurm import HealthCheck, JobTimeLimits, NodeSet, PowerSaving
from infra.cloud_init.slurm_packages import DEFAULT_SLURM_VERSION
from infra.health_thresholds import node_health
from infra.skus import GPU_SKUS

SKUS = sorted(GPU_SKUS)
BLOB_PULL = '#!/usr/bin/env python3\n"""Stand-in for dtrain/remote/boot/blob_pull.py."""\nprint("pulled")\n'
ACR = "trainacr.azurecr.io"
CLIENT_ID = "0f0e0d0c-0b0a-0908-0706-050403020100"
HEAD_CLIENT_ID = "1f1e1d1c-1b1a-1918-1716-151413121110"
KEY_VAULT_URI = "https://hvdkv1a2b3c4d.vault.azure.net/"
NFS_IP = "10.0.1.4"
LUSTRE_MGS = "10.0.3.5"
NFS_SHARE = NfsShare(NFS_IP, "/export")
LUSTRE_SHARE = LustreShare(LUSTRE_MGS)
HEAD_IP = "10.0.0.254"
CLUSTER_CIDR = "10.0.0.0/24"
SCALE_SET_ID = "/subscriptions/sub-1/resourceGroups/rg-1/providers/Microsoft.Compute/virtualMachineScaleSets/vmss-1"
NODE_NAMES = ["hvd-gpu-000000", "hvd-gpu-000001", "hvd-gpu-00000a"]
MYSQL_HOST = "hvdacct.mysql.database.azure.com"


def accounting(*, mysql: bool = False) -> HeadAccounting:
    """slurmdbd with MariaDB on the head node, or with an Azure Database for MySQL."""
    database = (
        AccountingDatabase(host=MYSQL_HOST, user="slurmdbd", ssl_ca=AZURE_MYSQL_CA_BUNDLE)
        if mysql
        else AccountingDatabase(host=LOOPBACK)
    )
    return HeadAccounting(
        cluster_name="hvd",
        dbd_host="hvd-head",
        dbd_address=HEAD_IP,
        database=database,
        users=["hpcadmin"],
    )


def nfs_doc(**overrides: object) -> str:
    args: dict[str, object] = {
        "data_disk_count": 4,
        "export_path": "/export",
        "allowed_cidr": CLUSTER_CIDR,
        "blob_pull_script": BLOB_PULL,
    }
    return render_nfs_server(**{**args, **overrides})  # type: ignore[arg-type]


def node_doc(sku: str = "Standard_ND96isr_H100_v5", **overrides: object) -> str:
    args: dict[str, object] = {
        "shared": NFS_SHARE,
        "mount_path": "/mnt/shared",
        "acr_login_server": ACR,
        "identity_client_id": CLIENT_ID,
        "nccl_env": dict(GPU_SKUS[sku].nccl_env),
        "expected_gpus": 8,
        "health": node_health(sku),
        "slurmctld_address": HEAD_IP,
        "key_vault_uri": KEY_VAULT_URI,
        "nvme_disks": GPU_SKUS[sku].nvme_disks,
        "nvme_mount": GPU_SKUS[sku].nvme_mount,
        "admin_user": "hpcadmin",
        "slurm_version": DEFAULT_SLURM_VERSION,
    }
    return render_cluster_node(**{**args, **overrides})  # type: ignore[arg-type]


def power(suspend_time_s: int | None = 1800) -> PowerSaving:
    return PowerSaving(
        suspend_program="/usr/local/sbin/slurm-suspend",
        resume_program="/usr/local/sbin/slurm-resume",
        resume_fail_program="/usr/local/sbin/slurm-resume-fail",
        suspend_time_s=suspend_time_s,
        suspend_timeout_s=600,
        resume_timeout_s=1800,
    )


def slurm_conf(**overrides: object) -> str:
    args: dict[str, object] = {
        "cluster_name": "hvd",
        "controller_host": "hvd-head",
        "controller_address": HEAD_IP,
        "partition": "gpu",
        "nodes": NodeSet(names=NODE_NAMES, cpus=96, real_memory_mb=1_751_040, gpus=8),
        "state_save_dir": "/var/spool/slurmctld",
        "slurmd_spool_dir": "/var/spool/slurmd",
        "power": power(),
        "health_check": HealthCheck(program="/usr/local/sbin/slurm-health-check", interval_s=300),
        "prolog": "/usr/local/sbin/slurm-prolog",
        "epilog": "/usr/local/sbin/slurm-epilog",
        "job_time": JobTimeLimits(),
    }
    return render_slurm_conf(**{**args, **overrides})  # type: ignore[arg-type]


def head_doc(**overrides: object) -> str:
    args: dict[str, object] = {
        "slurm_conf": slurm_conf(),
        "gres_conf": render_gres_conf(8),
        "cgroup_conf": render_cgroup_conf(),
        "slurm_version": DEFAULT_SLURM_VERSION,
        "key_vault_uri": KEY_VAULT_URI,
        "shared": NFS_SHARE,
        "mount_path": "/mnt/shared",
        "scale_set_id": SCALE_SET_ID,
        "identity_client_id": HEAD_CLIENT_ID,
        "node_prefix": "hvd-gpu-",
        "admin_user": "hpcadmin",
        "register_timeout_s": 1800,
        "controller_grace_s": 3600,
        "power_down_unused": True,
        "telemetry_nodes": ["hvd-gpu-000000", "hvd-gpu-000001"],
        "tracking": {
            "listen_ip": "10.40.63.254",
            "results_endpoint": "https://hvdsa.blob.core.windows.net/",
            "container": "results",
            "identity_client_id": "44444444-4444-4444-4444-444444444444",
        },
        "accounting": accounting(),
    }
    return render_head_node(**{**args, **overrides})  # type: ignore[arg-type]


DOCUMENTS = {
    **{f"nfs-{count}-disks": nfs_doc(data_disk_count=count) for count in (1, 2, 4)},
    **{f"node-{sku}": node_doc(sku) for sku in SKUS},
    "head": head_doc(),
    "head-mysql": head_doc(accounting=accounting(mysql=True)),
    "node-lustre": node_doc(shared=LUSTRE_SHARE),
    "head-lustre": head_doc(shared=LUSTRE_SHARE),
}


def files_of(document: str) -> dict[str, dict[str, object]]:
    return {entry["path"]: entry for entry in yaml.safe_load(document)["write_files"]}


def script_of(document: str, path: str) -> str:
    content = files_of(document)[path]["content"]
    assert isinstance(content, str)
    return content


# The setup program of each role, whose first step installs the role's packages (PACKAGES).
SETUP_PROGRAMS = ("/usr/local/sbin/node-setup", "/usr/local/sbin/head-setup")


def setup_packages(document: str) -> list[str]:
    """What the document's setup program installs: names, and name=version (Slurm's)."""
    (program,) = [path for path in SETUP_PROGRAMS if path in files_of(document)]
    (line,) = [line for line in script_of(document, program).splitlines() if line.startswith("PACKAGES=(")]
    return shlex.split(line.removeprefix("PACKAGES=(").removesuffix(")"))


def shell_scripts() -> dict[str, tuple[str, str]]:
    """Every distinct embedded shell script as id -> (shell, text), runcmd included."""
    found: dict[str, tuple[str, str]] = {}
    for name, document in DOCUMENTS.items():
        parsed = yaml.safe_load(document)
        for entry in parsed["write_files"]:
            content = entry["content"]
            if content.startswith(("#!/bin/bash", "#!/bin/sh")) or entry["path"].endswith(".sh"):
                shell = "bash" if content.startswith("#!/bin/bash") else "sh"
                found.setdefault(f"{name}:{entry['path']}", (shell, content))
        # cloud-init writes runcmd out as a /bin/sh script, one line per item.
        lines = [item if isinstance(item, str) else shlex.join(item) for item in parsed["runcmd"]]
        found[f"{name}:runcmd"] = ("sh", "\n".join(lines) + "\n")
    return found


SHELL_SCRIPTS = shell_scripts()


def decode_custom_data(custom_data: str) -> str:
    """The cloud-config a customData property carries (base64 of the gzipped document)."""
    return gzip.decompress(base64.b64decode(custom_data)).decode()
