"""cloud-config for a GPU node on the Azure HPC image (microsoft-dsvm ubuntu-hpc 22.04).

The image already carries the GPU, InfiniBand and NCCL drivers, docker, the NVIDIA container
toolkit, and Microsoft's Slurm repository key and apt pin; this adds the NFS mount, the RAID 0
over the local NVMe disks (built again at every boot that finds them empty), the registry login,
the NCCL settings, Azure's node health checks for the size at every boot before slurmd
(azure_checks.py), and slurmd (configless; Microsoft's packages at the stack's slurmVersion, as on
the head node: slurm_packages.py) with its health check and the epilog that removes a job's
containers, and the Spot agent that turns an eviction notice into a checkpoint and a requeue.
Slurm knows its nodes: nothing else records them.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from infra.cloud_init._common import (
    check_client_id,
    check_hostname,
    check_int,
    check_ipv4,
    check_path,
    check_user,
    cloud_config,
    munge_key_fetch_file,
    read_unit,
    remote_file,
    render_script,
    start_setup_unit,
    write_file,
)
from infra.cloud_init.azure_checks import AZURE_CHECKS_PATH, AZURE_CHECKS_RESULT, AZURE_CHECKS_UNIT, render_azure_checks
from infra.cloud_init.nccl import check_nccl_env
from infra.cloud_init.prometheus import NODE_EXPORTER_PACKAGE
from infra.cloud_init.shared_storage import SharedFileSystem, SharedMount, release_files, shared_mount
from infra.cloud_init.slurm import MAX_GPUS_PER_NODE, render_health_check
from infra.cloud_init.slurm_packages import (
    MUNGE_PACKAGE,
    SLURMD_PACKAGES,
    account_commands,
    apt_files,
    versioned,
)
from infra.cloud_init.users import SSHD_RELOAD, on_shared, users_files
from infra.contract import BOOT_REPORT_DIR, MIN_FREE_DISK_GB, SLURMCTLD_PORT
from infra.health_thresholds import NodeHealth

ACR_LOGIN_PATH = "/usr/local/sbin/acr-login"
NODE_SETUP_PATH = "/usr/local/sbin/node-setup"
NVME_RAID_PATH = "/usr/local/sbin/nvme-raid"
# For the operator's and jobs' use: copies a dataset from the shared file system to the NVMe volume.
NVME_COPY_PATH = "/usr/local/bin/nvme-copy"
SLURMD_SETUP_PATH = "/usr/local/sbin/slurmd-setup"
HEALTH_CHECK_PATH = "/usr/local/sbin/slurm-health-check"
PROLOG_PATH = "/usr/local/sbin/slurm-prolog"
EPILOG_PATH = "/usr/local/sbin/slurm-epilog"
SPOT_AGENT_PATH = "/usr/local/sbin/spot-agent"  # spot-agent.service runs it (dtrain/remote/boot/spot_agent.py)
# The master copy; nccl-conf.service installs it as /etc/nccl.conf after the image's own rewrite.
NCCL_CONF_SOURCE = "/usr/local/etc/nccl.conf"
NCCL_PROFILE_PATH = "/etc/profile.d/nccl.sh"
UNITS_DIR = "/etc/systemd/system"
NODE_SETUP_UNIT = "node-setup.service"  # runs node-setup at every boot until it has succeeded
UNITS = (
    "acr-login.service",
    "acr-login.timer",
    "acr-login-boot.service",
    "nccl-conf.service",
    AZURE_CHECKS_UNIT,
    NODE_SETUP_UNIT,
    "nvme-raid.service",
    "spot-agent.service",
    "dcgm-exporter.service",
)
# The group of the docker daemon's socket (the image's docker package makes it): the admin user joins it.
DOCKER_GROUP = "docker"
SLURMD_DROP_IN = f"{UNITS_DIR}/slurmd.service.d/configless.conf"
# Where framework images land: the disk the health check keeps free space on.
DOCKER_DATA_PATH = "/var/lib/docker"
# What node-setup's first step installs besides Slurm's own (slurm_packages.SLURMD_PACKAGES, versioned):
# mdadm and xfsprogs, the NVMe volume; prometheus-node-exporter, the node's metrics for the head node's
# Prometheus (infra/cloud_init/prometheus.py).
PACKAGES = ["nfs-common", MUNGE_PACKAGE, "mdadm", "xfsprogs", NODE_EXPORTER_PACKAGE]
# Azure has at most 8 local NVMe disks on the sizes in infra/skus.py; 0 stands for "not stated".
MAX_NVME_DISKS = 8


def render_cluster_node(
    *,
    shared: SharedFileSystem,
    mount_path: str,
    acr_login_server: str,
    identity_client_id: str,
    nccl_env: Mapping[str, str],
    expected_gpus: int,
    health: NodeHealth,
    slurmctld_address: str,
    key_vault_uri: str,
    nvme_disks: int | None,
    nvme_mount: str,
    admin_user: str,
    slurm_version: str,
) -> str:
    """cloud-config that mounts the shared file system (the NFS export or the Lustre file system that
    `shared` names) at mount_path, logs docker in to ACR with the managed identity, writes the
    NCCL settings, and starts slurmd against the controller at slurmctld_address with the
    cluster's munge key, fetched from the Key Vault at key_vault_uri with the identity; slurm.conf
    names the health check, prolog and epilog installed here. admin_user (who submits the jobs) may run
    docker, and its docker client holds the registry login.
    health: the size's thresholds (infra/health_thresholds.py): Azure's checks at boot run its
    configuration, and the health check counts its InfiniBand ports at their rate.
    nvme_disks local NVMe disks (None: as many as the node has) become a RAID 0 at nvme_mount.
    slurm_version: the Slurm that slurmd is installed at, the head node's."""
    mount = check_path("mount_path", mount_path)
    share = shared_mount(shared, mount)
    acr = check_hostname("acr_login_server", acr_login_server)
    client_id = check_client_id("identity_client_id", identity_client_id)
    env = check_nccl_env(nccl_env)
    gpus = check_int("expected_gpus", expected_gpus, 1, MAX_GPUS_PER_NODE)
    admin = check_user("admin_user", admin_user)
    controller = f"{check_ipv4('slurmctld_address', slurmctld_address)}:{SLURMCTLD_PORT}"
    nvme = _nvme_settings(nvme_disks, nvme_mount)
    packages = [*PACKAGES, *versioned(SLURMD_PACKAGES, slurm_version)]
    programs = _programs(
        mount=mount,
        share=share,
        acr=acr,
        client_id=client_id,
        admin=admin,
        controller=controller,
        nvme=nvme,
        gpus=gpus,
        health=health,
        packages=packages,
    )
    return cloud_config(
        {
            # Never upgrade on the HPC image: its kernel, OFED and GPU drivers are a tested set. No
            # `packages` either: node-setup installs them, at every run until they are there.
            "package_upgrade": False,
            "bootcmd": account_commands(),
            "write_files": [
                *apt_files(slurm_version),
                *share.files,
                *release_files(shared, mount),
                *(write_file(path, text, "0755") for path, text in programs),
                *_unit_files(),
                *_nccl_files(env),
                munge_key_fetch_file(vault_uri=key_vault_uri, identity_client_id=identity_client_id),
                *users_files(on_shared(mount)),  # node-setup starts applying the list once /shared is there
            ],
            "runcmd": [SSHD_RELOAD, *start_setup_unit(NODE_SETUP_UNIT)],
        }
    )


def _nvme_settings(nvme_disks: int | None, nvme_mount: str) -> dict[str, str | int]:
    """nvme-raid's settings, checked: where the RAID 0 is mounted, and how many disks make it (0: all found)."""
    return {
        "MOUNT_PATH": check_path("nvme_mount", nvme_mount),
        "EXPECTED_DISKS": 0 if nvme_disks is None else check_int("nvme_disks", nvme_disks, 1, MAX_NVME_DISKS),
    }


def _programs(
    *,
    mount: str,
    share: SharedMount,
    acr: str,
    client_id: str,
    admin: str,
    controller: str,
    nvme: dict[str, str | int],
    gpus: int,
    health: NodeHealth,
    packages: list[str],
) -> list[tuple[str, str]]:
    """(path, text) of every program a node installs, from checked values: boot steps, Slurm's hooks, the Spot agent."""
    return [
        (
            ACR_LOGIN_PATH,
            render_script(
                "boot/acr-login.sh",
                {"ACR_LOGIN_SERVER": acr, "IDENTITY_CLIENT_ID": client_id, "ADMIN_USER": admin},
            ),
        ),
        (
            NODE_SETUP_PATH,
            render_script(
                "boot/node-setup.sh",
                {
                    "SHARED_MOUNT": mount,
                    "MOUNT_STEP": share.step,
                    "REPORT_DIR": BOOT_REPORT_DIR,
                    "ADMIN_USER": admin,
                    "DOCKER_GROUP": DOCKER_GROUP,
                    "PACKAGES": packages,
                    "AZURE_CHECKS_RESULT": AZURE_CHECKS_RESULT,
                },
            ),
        ),
        (AZURE_CHECKS_PATH, render_azure_checks(health)),
        (NVME_RAID_PATH, render_script("boot/nvme-raid.sh", nvme)),
        (NVME_COPY_PATH, remote_file("job/nvme_copy.py")),
        (SLURMD_SETUP_PATH, render_script("boot/slurmd-setup.sh", {"SLURMCTLD_ADDRESS": controller})),
        (
            HEALTH_CHECK_PATH,
            render_health_check(
                shared_mount=mount,
                expected_gpus=gpus,
                health=health,
                min_free_gb=MIN_FREE_DISK_GB,
                free_disk_path=DOCKER_DATA_PATH,
            ),
        ),
        (PROLOG_PATH, render_script("slurm/slurm-prolog.sh", {})),
        (EPILOG_PATH, render_script("slurm/slurm-epilog.sh", {})),
        (SPOT_AGENT_PATH, remote_file("boot/spot_agent.py")),
    ]


def _unit_files() -> list[dict[str, Any]]:
    """Our systemd units, and the drop-in that makes slurmd configless."""
    return [
        *(write_file(f"{UNITS_DIR}/{unit}", read_unit(unit), "0644") for unit in UNITS),
        write_file(SLURMD_DROP_IN, read_unit("slurmd-configless.conf"), "0644"),
    ]


def _nccl_files(env: Mapping[str, str]) -> list[dict[str, Any]]:
    """The checked NCCL settings twice: nccl.conf's master copy, and a login shell's profile."""
    nccl_conf = "".join(f"{key}={value}\n" for key, value in env.items())
    nccl_profile = "# NCCL/UCX settings of this cluster, as in /etc/nccl.conf; written by cloud-init.\n" + "".join(
        f"export {key}={shlex.quote(value)}\n" for key, value in env.items()
    )
    return [write_file(NCCL_CONF_SOURCE, nccl_conf, "0644"), write_file(NCCL_PROFILE_PATH, nccl_profile, "0644")]
