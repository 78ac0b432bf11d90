"""cloud-config for the head node (the nodes' image, ubuntu-hpc 22.04): slurmctld and slurmdbd from the
same repository at the same version as the nodes' slurmd (slurm_packages.py), slurmdbd's database
(MariaDB on the node's own data disk, or an Azure Database for MySQL: accounting.py), the programs that
power the scale set's nodes down and up, the timer that deallocates nodes that never registered, and
the shared file system for the login node."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from infra.azure_limits import COMPUTER_NAME_PREFIX
from infra.cloud_init._common import (
    check_client_id,
    check_int,
    check_user,
    cloud_config,
    munge_key_fetch_file,
    read_unit,
    remote_file,
    render_script,
    start_setup_unit,
    write_file,
)
from infra.cloud_init.accounting import MARIADB_PACKAGE, HeadAccounting, head_accounting_files
from infra.cloud_init.mlflow import PACKAGES as MLFLOW_PACKAGES
from infra.cloud_init.mlflow import mlflow_commands, mlflow_files
from infra.cloud_init.prometheus import PROMETHEUS_PACKAGE, head_prometheus_files
from infra.cloud_init.shared_storage import (
    LustreShare,
    SharedFileSystem,
    SharedMount,
    data_dir,
    lustre_head_files,
    shared_mount,
)
from infra.cloud_init.slurm_packages import (
    MUNGE_PACKAGE,
    SLURM_USER,
    SLURMCTLD_PACKAGES,
    account_commands,
    apt_files,
    versioned,
)
from infra.cloud_init.users import SEED_PATH, SSHD_RELOAD, on_shared, seed_file, users_files
from infra.contract import BOOT_REPORT_DIR, DATA_DIR_NAME, RUNS_DIR
from infra.users import LIST_FILE, USERS_DIR, UsersList

SLURM_CONF_PATH = "/etc/slurm/slurm.conf"
GRES_CONF_PATH = "/etc/slurm/gres.conf"
CGROUP_CONF_PATH = "/etc/slurm/cgroup.conf"
HEAD_SETUP_PATH = "/usr/local/sbin/head-setup"
HEAD_SETUP_UNIT = "head-setup.service"  # runs head-setup at every boot until it has succeeded
STATE_SAVE_DIR = "/var/spool/slurmctld"
SLURM_LOG_DIR = "/var/log/slurm"
POWER_PROGRAM_PATH = "/usr/local/sbin/slurm-power"
POWER_CONFIG_PATH = "/etc/slurm/azure-power.json"  # slurm_power.py's default
POWER_LOG_PATH = f"{SLURM_LOG_DIR}/power.log"
# Made by the reaper's first round that finds slurmctld silent; its time starts the grace. In the
# reaper's RuntimeDirectory (slurm-power-reap.service): a reboot starts the count again.
SILENCE_FILE_PATH = "/run/slurm-power/slurmctld-silent-since"
# What slurm.conf names as its programs, and the slurm-power action each one runs.
SUSPEND_PROGRAM = "/usr/local/sbin/slurm-suspend"
RESUME_PROGRAM = "/usr/local/sbin/slurm-resume"
RESUME_FAIL_PROGRAM = "/usr/local/sbin/slurm-resume-fail"
POWER_ACTIONS = {SUSPEND_PROGRAM: "suspend", RESUME_PROGRAM: "resume", RESUME_FAIL_PROGRAM: "resume-fail"}
# How long suspend and the reaper wait for the nodes to release a Lustre file system before they deallocate
# them: the node's agent reads the request within 5 s (spot_agent.py, --release-poll), and its release
# takes 60 s at most (10 s from SIGTERM to SIGKILL for what still writes, the flush, the unmount); far
# below Slurm's SuspendTimeout (infra/head.py).
RELEASE_WAIT_S = 90
# `slurm-power reap`, every 5 minutes: deallocates the nodes that Azure runs and Slurm holds as off.
REAP_UNITS = ("slurm-power-reap.service", "slurm-power-reap.timer")
UNITS_DIR = "/etc/systemd/system"
# What head-setup's first step installs besides Slurm's own (slurm_packages.SLURMCTLD_PACKAGES, versioned;
# sbatch and friends for the login node), and Prometheus's and MLflow's where they run.
PACKAGES = ["nfs-common", MUNGE_PACKAGE]
# A scale set's id as Azure Resource Manager writes it; nothing that would bend the URL built on it.
_SCALE_SET_ID = re.compile(r"/subscriptions/[^\s/?#]+(/[^\s/?#]+)+")


def _power_wrapper(action: str) -> str:
    return f'#!/bin/sh\n# Run by slurmctld as SlurmUser.\nexec {POWER_PROGRAM_PATH} {action} "$@"\n'


def _check_scale_set(scale_set_id: str, node_prefix: str) -> None:
    if not _SCALE_SET_ID.fullmatch(scale_set_id or ""):
        raise ValueError(f"scale_set_id: {scale_set_id!r} is not an Azure resource id")
    if not COMPUTER_NAME_PREFIX.admits(node_prefix or ""):
        # infra/config.py refuses a namePrefix that would come here: this is the last guard, not the check
        raise ValueError(f"node_prefix: {node_prefix!r} is not a computer name prefix ({COMPUTER_NAME_PREFIX.allowed})")


def render_head_node(
    *,
    slurm_conf: str,
    gres_conf: str,
    cgroup_conf: str,
    slurm_version: str,
    key_vault_uri: str,
    shared: SharedFileSystem,
    mount_path: str,
    scale_set_id: str,
    identity_client_id: str,
    node_prefix: str,
    admin_user: str,
    register_timeout_s: int,
    controller_grace_s: int,
    power_down_unused: bool,
    spot_scale_set: dict[str, str] | None = None,
    accounting: HeadAccounting,
    telemetry_nodes: Sequence[str] = (),
    tracking: dict[str, str] | None = None,
    users: UsersList | None = None,
) -> str:
    """cloud-config that installs slurmctld at slurm_version (the nodes' slurmd's) with slurm_conf,
    gres_conf and cgroup_conf (slurmd fetches all three, configless), the program that fetches
    the cluster's munge key from the Key Vault at key_vault_uri, the power programs acting on
    scale_set_id (both through the identity identity_client_id),
    mounts the shared file system (`shared`: the NFS export, or Lustre, for which it also installs
    blob-pull and makes the data directory) at mount_path, and gives the runs directory there to admin_user (who
    submits the jobs). register_timeout_s: how long a node that Slurm did not start may run without
    registering before the timer deallocates it. controller_grace_s: how long slurmctld may leave the
    timer unanswered before it deallocates every instance, Slurm being unable to vouch for any.
    power_down_unused: the timer also powers down, at
    once, registered nodes that came up outside Slurm and sit idle (autostop on; off, idle nodes stay
    up as asked). spot_scale_set: the Spot nodes' scale set (scale_set_id, node_prefix and the
    identity_client_id that powers it), powered the same way. telemetry_nodes: Slurm's nodes, whose
    exporters Prometheus scrapes (infra/cloud_init/prometheus.py); none: no Prometheus. tracking: the
    MLflow server's listen_ip, results_endpoint, container and identity_client_id
    (infra/cloud_init/mlflow.py). accounting: slurmdbd and its database (infra/cloud_init/accounting.py),
    whose password the node reads from the Key Vault with identity_client_id. users: the stack config's
    users list, which seeds the one the head node keeps on the shared file system (public keys only; None:
    nobody yet)."""
    _check_head_inputs(
        scale_set_id=scale_set_id,
        node_prefix=node_prefix,
        admin_user=admin_user,
        power_down_unused=power_down_unused,
        slurm_files={"slurm_conf": slurm_conf, "gres_conf": gres_conf, "cgroup_conf": cgroup_conf},
    )
    power_config = _power_config(
        scale_set_id=scale_set_id,
        identity_client_id=identity_client_id,
        node_prefix=node_prefix,
        register_timeout_s=register_timeout_s,
        controller_grace_s=controller_grace_s,
        power_down_unused=power_down_unused,
        spot_scale_set=spot_scale_set,
        release_wait_s=RELEASE_WAIT_S if isinstance(shared, LustreShare) else None,
    )
    share = shared_mount(shared, mount_path)
    packages = _packages(slurm_version, telemetry_nodes, tracking, accounting)
    setup = _head_setup_script(share, data_dir(shared, f"{mount_path}/{DATA_DIR_NAME}"), admin_user, packages)
    return cloud_config(
        {
            # No `packages`: head-setup installs them, at every run until they are there.
            "bootcmd": account_commands(),
            "write_files": [
                *apt_files(slurm_version),
                *share.files,
                *lustre_head_files(shared),
                write_file(HEAD_SETUP_PATH, setup, "0755"),
                write_file(f"/etc/systemd/system/{HEAD_SETUP_UNIT}", read_unit(HEAD_SETUP_UNIT), "0644"),
                *_power_program_files(),
                *_deferred_slurm_files(slurm_conf, gres_conf, cgroup_conf, power_config),
                munge_key_fetch_file(vault_uri=key_vault_uri, identity_client_id=identity_client_id),
                *head_accounting_files(accounting, vault_uri=key_vault_uri, identity_client_id=identity_client_id),
                *(write_file(f"{UNITS_DIR}/{unit}", remote_file(f"slurm/{unit}"), "0644") for unit in REAP_UNITS),
                *_service_files(telemetry_nodes, tracking),
                *users_files(on_shared(mount_path, head=True)),
                seed_file(SEED_PATH, users or UsersList()),
            ],
            "runcmd": _run_commands(telemetry_nodes, tracking),
        }
    )


def _check_head_inputs(
    *, scale_set_id: str, node_prefix: str, admin_user: str, power_down_unused: bool, slurm_files: dict[str, str]
) -> None:
    """The refusals that come before anything is rendered (the rest come with what they render)."""
    _check_scale_set(scale_set_id, node_prefix)
    check_user("admin_user", admin_user)
    if not isinstance(power_down_unused, bool):
        raise ValueError(f"power_down_unused: {power_down_unused!r} is not a bool")
    for key, text in slurm_files.items():
        if not isinstance(text, str) or not text.endswith("\n"):
            raise ValueError(f"{key}: must be the file's text, ending in a newline")


def _power_config(
    *,
    scale_set_id: str,
    identity_client_id: str,
    node_prefix: str,
    register_timeout_s: int,
    controller_grace_s: int,
    power_down_unused: bool,
    spot_scale_set: dict[str, str] | None,
    release_wait_s: int | None,
) -> dict[str, object]:
    """slurm-power's configuration (POWER_CONFIG_PATH): the scale sets it powers and how; release_wait_s:
    how long it waits for the nodes to release the shared file system before it deallocates them (None:
    nothing to release)."""
    power_config: dict[str, object] = {
        "scale_set_id": scale_set_id,
        "identity_client_id": check_client_id("identity_client_id", identity_client_id),
        "node_prefix": node_prefix,
        "log_file": POWER_LOG_PATH,
        "register_timeout_s": check_int("register_timeout_s", register_timeout_s, 60, 86400),
        "controller_grace_s": check_int("controller_grace_s", controller_grace_s, 60, 86400),
        "silence_file": SILENCE_FILE_PATH,
        "power_down_unused": power_down_unused,
    }
    if spot_scale_set is not None:
        _check_scale_set(spot_scale_set["scale_set_id"], spot_scale_set["node_prefix"])
        check_client_id("spot identity_client_id", spot_scale_set["identity_client_id"])
        power_config["spot"] = dict(spot_scale_set)
    if release_wait_s is not None:
        power_config["release_wait_s"] = release_wait_s
    return power_config


def _head_setup_script(share: SharedMount, data_dir: str, admin_user: str, packages: list[str]) -> str:
    """head-setup (HEAD_SETUP_PATH), which head-setup.service runs at every boot until it has succeeded;
    its first step installs packages. data_dir: the directory it makes for the datasets ("": none)."""
    return render_script(
        "boot/head-setup.sh",
        {
            "SLURM_USER": SLURM_USER,
            "SLURM_DIRS": [STATE_SAVE_DIR, SLURM_LOG_DIR],
            "MOUNT_PROGRAM": share.program,
            "DATA_DIR": data_dir,
            "SHARED_MOUNT": share.mount_path,
            "RUNS_DIR": RUNS_DIR,
            "RUNS_OWNER": admin_user,
            "USERS_DIR": USERS_DIR,
            "USERS_LIST": LIST_FILE,
            "USERS_SEED": SEED_PATH,
            "REPORT_DIR": BOOT_REPORT_DIR,
            "PACKAGES": packages,
        },
    )


def _packages(
    slurm_version: str, telemetry_nodes: Sequence[str], tracking: dict[str, str] | None, accounting: HeadAccounting
) -> list[str]:
    """Ours, slurmctld's and slurmdbd's at slurm_version, MariaDB where the database is on the node, and
    Prometheus's and MLflow's where they run."""
    return [
        *PACKAGES,
        *versioned(SLURMCTLD_PACKAGES, slurm_version),
        *([MARIADB_PACKAGE] if accounting.local else []),
        *([PROMETHEUS_PACKAGE] if telemetry_nodes else []),
        *(MLFLOW_PACKAGES if tracking else []),
    ]


def _power_program_files() -> list[dict[str, Any]]:
    """slurm-power and the suspend, resume and resume-fail programs that slurm.conf names, which run it."""
    return [
        write_file(POWER_PROGRAM_PATH, render_script("slurm/slurm_power.py", {}), "0755"),
        *(write_file(path, _power_wrapper(action), "0755") for path, action in POWER_ACTIONS.items()),
    ]


def _deferred_slurm_files(
    slurm_conf: str, gres_conf: str, cgroup_conf: str, power_config: dict[str, object]
) -> list[dict[str, Any]]:
    """Slurm's configuration and slurm-power's, in cloud-init's last stage: before head-setup installs
    the packages (slurmctld's may start the daemon on it: head-setup's next step restarts it with the
    cluster's munge key)."""
    return [
        write_file(SLURM_CONF_PATH, slurm_conf, "0644", defer=True),
        write_file(GRES_CONF_PATH, gres_conf, "0644", defer=True),
        write_file(CGROUP_CONF_PATH, cgroup_conf, "0644", defer=True),
        write_file(POWER_CONFIG_PATH, json.dumps(power_config, indent=2) + "\n", "0644", defer=True),
    ]


def _service_files(telemetry_nodes: Sequence[str], tracking: dict[str, str] | None) -> list[dict[str, Any]]:
    """Prometheus's files where telemetry_nodes are scraped, MLflow's where tracking is on."""
    return [
        *(head_prometheus_files(telemetry_nodes) if telemetry_nodes else []),
        *(mlflow_files(tracking) if tracking else []),
    ]


def _run_commands(telemetry_nodes: Sequence[str], tracking: dict[str, str] | None) -> list[list[str]]:
    """runcmd: the reaper's timer, head-setup, then MLflow where it runs (Prometheus starts on its
    package's install, which comes after its configuration)."""
    setup_start = start_setup_unit(HEAD_SETUP_UNIT)
    # The reaper's timer before the setup: a head-setup that fails or waits must not leave nodes
    # billing unseen.
    return [
        setup_start[0],
        ["systemctl", "enable", "--now", REAP_UNITS[1]],
        SSHD_RELOAD,  # people's keys (dtrain-users): head-setup starts applying the list once /shared is there
        *setup_start[1:],
        *(mlflow_commands() if tracking else []),
    ]
