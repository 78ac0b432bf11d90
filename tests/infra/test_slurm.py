"""Slurm's side of the cluster: slurm.conf and gres.conf, the node health check and its report, the
epilog that removes a job's containers, the power program that starts and deallocates scale-set
instances, and the head node's cloud-config.

The health check runs here against stand-ins for nvidia-smi, mountpoint, df, scontrol, the
InfiniBand ports' sysfs and the verdict of Azure's checks at boot, the
epilog against a stand-in docker; the power program runs against a fake Azure (IMDS and Resource
Manager on a local HTTP server).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from rich.console import Console

from dtrain.cli.jobs import nodes_table, summary
from dtrain.cluster.slurm import NODE_FIELDS, parse_nodes
from dtrain.local.slurm_conf import CLOUD_REG_ADDRS, PRIVATE_DATA, conf_value, override
from dtrain.pricing import count_nodes, estimate_cost, load_price_table
from infra.cloud_init import render_cgroup_conf, render_gres_conf, render_health_check
from infra.cloud_init._common import MUNGE_KEY_FETCH_PATH, MUNGE_KEY_PATH
from infra.cloud_init.azure_checks import AZURE_CHECKS_PATH as AZURE_CHECKS
from infra.cloud_init.head_node import (
    HEAD_SETUP_PATH,
    POWER_ACTIONS,
    POWER_CONFIG_PATH,
    POWER_LOG_PATH,
    POWER_PROGRAM_PATH,
    REAP_UNITS,
    SILENCE_FILE_PATH,
    UNITS_DIR,
)
from infra.cloud_init.mlflow import mlflow_commands
from infra.cloud_init.shared_storage import LustreShare, NfsShare
from infra.cloud_init.slurm import MIN_KILL_WAIT_S, JobTimeLimits, NodeSet
from infra.cloud_init.slurm_packages import SLURM_USER, account_commands
from infra.config import parse_config
from infra.contract import HEALTH_REPORT_DIR, SRUN_PORTS
from infra.health_thresholds import LOCAL_HEALTH, node_health
from tests.infra.conftest import PROJECT, VALID_CONFIG
from tests.infra.documents import (
    CLIENT_ID,
    HEAD_CLIENT_ID,
    HEAD_IP,
    KEY_VAULT_URI,
    NODE_NAMES,
    SCALE_SET_ID,
    SKUS,
    files_of,
    head_doc,
    node_doc,
    power,
    script_of,
    setup_packages,
    slurm_conf,
)
from tests.infra.sandbox import Sandbox, add_port, shell_value, systemd_verify, tool, with_value
from tests.local_http import reply_json, serving

HEALTH_CHECK = "/usr/local/sbin/slurm-health-check"
EPILOG = "/usr/local/sbin/slurm-epilog"
PROLOG = "/usr/local/sbin/slurm-prolog"
NODE = "hvd-gpu-000001"
TOKEN = "ARM-SECRET-eyJhbGciOiJSUzI1NiJ9"
SPOT_SCALE_SET_ID = SCALE_SET_ID.replace("/vmss-1", "/vmss-spot")


def parse_slurm_conf(text: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(global settings, {'NodeName'|'PartitionName': that line's settings}), comments dropped."""
    settings: dict[str, str] = {}
    lines: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key = line.split("=", 1)[0]
        if key in ("NodeName", "PartitionName"):
            assert key not in lines, f"more than one {key} line"
            lines[key] = dict(word.split("=", 1) for word in line.split())
        else:
            assert key not in settings, f"{key} is set twice"
            settings[key] = line.split("=", 1)[1]
    return settings, lines


# --- slurm.conf and gres.conf ---------------------------------------------------------------


def test_slurm_conf_has_one_gpu_partition_of_the_named_cloud_nodes() -> None:
    settings, lines = parse_slurm_conf(slurm_conf())
    assert lines["NodeName"] == {
        "NodeName": ",".join(NODE_NAMES),
        "CPUs": "96",
        "RealMemory": "1751040",
        "Gres": "gpu:8",
        "State": "CLOUD",
    }
    assert lines["PartitionName"] == {
        "PartitionName": "gpu",
        "Nodes": "ALL",
        "Default": "YES",
        "DefaultTime": "24:00:00",  # a job submitted by hand without --time ends too
        "MaxTime": "INFINITE",
        "State": "UP",
        "OverSubscribe": "NO",  # jobs hold the GPUs they ask for (gres), not whole nodes
        "DefCpuPerGPU": "12",  # with each GPU, its share of the node's cores
        "DefMemPerGPU": "218880",  # and of its memory (MB): a job that names no --mem gets neither 0 nor all
    }
    assert settings["GresTypes"] == "gpu"
    assert settings["ClusterName"] == "hvd"
    assert settings["SlurmctldHost"] == f"hvd-head({HEAD_IP})"


def test_slurm_conf_ports_auth_and_configless() -> None:
    settings, _ = parse_slurm_conf(slurm_conf())
    assert (settings["SlurmctldPort"], settings["SlurmdPort"], settings["SrunPortRange"]) == (
        "6817",
        "6818",
        SRUN_PORTS,
    )
    assert settings["AuthType"] == "auth/munge"
    # cloud_reg_addrs is defunct since 23.11 (an error at start), what it did the default
    assert set(settings["SlurmctldParameters"].split(",")) == {"enable_configless", "idle_on_node_suspend"}
    assert settings["ReturnToService"] == "2"
    assert "PrivateData" not in settings  # PrivateData=cloud is gone: cloud nodes are shown by default
    # Jobs tracked and confined by cgroups (cgroup.conf says what is constrained).
    assert settings["ProctrackType"] == "proctrack/cgroup"
    assert settings["TaskPlugin"] == "task/cgroup,task/affinity"


def test_slurm_conf_power_saving_suspends_after_the_autostop_time() -> None:
    settings, _ = parse_slurm_conf(slurm_conf(power=power(suspend_time_s=45 * 60)))
    assert {key: settings[key] for key in settings if key.startswith(("Suspend", "Resume"))} == {
        "SuspendProgram": "/usr/local/sbin/slurm-suspend",
        "ResumeProgram": "/usr/local/sbin/slurm-resume",
        "ResumeFailProgram": "/usr/local/sbin/slurm-resume-fail",
        "SuspendTime": "2700",
        "SuspendTimeout": "600",
        "ResumeTimeout": "1800",
    }


def test_slurm_conf_without_autostop_never_suspends_but_still_resumes() -> None:
    settings, _ = parse_slurm_conf(slurm_conf(power=power(suspend_time_s=None)))
    # Every node is in the excluded partition, so none is ever suspended for being idle...
    assert settings["SuspendExcParts"] == "gpu"
    # ...while the power-save module stays on (INFINITE or -1 would switch it off), so that a node
    # found powered down is still started for a job.
    assert int(settings["SuspendTime"]) > 0
    assert settings["ResumeProgram"] == "/usr/local/sbin/slurm-resume"


def test_slurm_conf_health_check_runs_on_every_node_state() -> None:
    settings, _ = parse_slurm_conf(slurm_conf())
    assert settings["HealthCheckProgram"] == HEALTH_CHECK
    assert settings["HealthCheckInterval"] == "300"
    assert settings["HealthCheckNodeState"] == "ANY"


def test_slurm_conf_ends_jobs_as_azure_needs() -> None:
    settings, _ = parse_slurm_conf(slurm_conf())
    assert {key: settings.get(key) for key in ("JobRequeue", "KillWait", "SlurmdTimeout", "UnkillableStepTimeout")} == {
        "JobRequeue": "0",  # requeued after a node failure only when submitted with --requeue
        "KillWait": "120",  # SIGTERM to SIGKILL: the batch script closes the run (its results) in it
        "SlurmdTimeout": "300",
        "UnkillableStepTimeout": "120",
    }
    assert settings["Epilog"] == EPILOG
    # every node of the allocation labels the job's GPUs as the job starts (the DCGM exporter's hpc_job)
    assert (settings["Prolog"], settings["PrologFlags"]) == (PROLOG, "Alloc")


def test_slurm_conf_takes_the_local_clusters_shorter_timeouts_and_no_epilog() -> None:
    settings, _ = parse_slurm_conf(slurm_conf(kill_wait_s=MIN_KILL_WAIT_S, slurmd_timeout_s=10, epilog=None))
    assert (settings["KillWait"], settings["SlurmdTimeout"], settings["UnkillableStepTimeout"]) == ("30", "10", "120")
    assert "Epilog" not in settings


def test_slurm_conf_for_cpu_nodes_has_no_gres() -> None:
    """The local cluster's shape: CPU nodes, no GPUs."""
    settings, lines = parse_slurm_conf(
        slurm_conf(nodes=NodeSet(names=["node-0", "node-1"], cpus=2, real_memory_mb=1024, gpus=0))
    )
    assert "GresTypes" not in settings
    assert "Gres" not in lines["NodeName"]
    assert lines["NodeName"]["NodeName"] == "node-0,node-1"
    # memory shared out per core where there are no GPUs to share it out by
    assert lines["PartitionName"]["DefMemPerCPU"] == "512" and "DefCpuPerGPU" not in lines["PartitionName"]


def test_memory_is_a_consumable_resource_that_cgroups_hold_each_job_to() -> None:
    """Without memory among the consumable resources, ConstrainRAMSpace holds a job to the node's whole
    RealMemory, whatever else runs there."""
    settings, _ = parse_slurm_conf(slurm_conf())
    assert settings["SelectType"] == "select/cons_tres"
    assert settings["SelectTypeParameters"] == "CR_Core_Memory"
    assert "ConstrainRAMSpace=yes" in render_cgroup_conf().splitlines()


def test_every_partition_takes_the_clusters_job_time_limits() -> None:
    spot = NodeSet(names=["hvd-spot-000000"], cpus=96, real_memory_mb=1_751_040, gpus=8)
    conf = slurm_conf(spot_nodes=spot, job_time=JobTimeLimits(default="4:00:00", maximum="3-00:00:00"))
    partitions = [line for line in conf.splitlines() if line.startswith("PartitionName=")]
    assert [line.split()[0] for line in partitions] == ["PartitionName=gpu", "PartitionName=spot"]
    assert all(" DefaultTime=4:00:00 MaxTime=3-00:00:00 " in line for line in partitions)
    # UNLIMITED is slurm.conf's INFINITE
    (unlimited,) = [
        line for line in slurm_conf(job_time=JobTimeLimits(maximum="unlimited")).splitlines() if "Partition" in line
    ]
    assert " DefaultTime=24:00:00 MaxTime=INFINITE " in unlimited
    # a job above MaxTime is refused when submitted (sbatch by hand included), not left pending
    assert "EnforcePartLimits=ANY" in conf.splitlines()


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        ({"default": "0"}, "job_time.default: '0': use Slurm's --time syntax"),
        ({"default": "INFINITE"}, "job_time.default"),  # a job that names no limit ends too
        ({"default": 60}, "job_time.default: 60: a time limit is text"),
        ({"maximum": "forever"}, "job_time.maximum: 'forever': use Slurm's --time syntax, e.g. 90 (minutes)"),
        ({"maximum": "4:00:00"}, "job_time.default: 24:00:00 is longer than job_time.maximum 4:00:00"),
    ],
)
def test_job_time_limits_are_checked_when_made(limits: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        JobTimeLimits(**limits)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"nodes": NodeSet(names=["Hvd-Gpu-00000A"], cpus=96, real_memory_mb=1024, gpus=8)}, "nodes.names"),
        ({"nodes": NodeSet(names=["n1", "n1"], cpus=96, real_memory_mb=1024, gpus=8)}, "nodes.names"),
        ({"nodes": NodeSet(names=[], cpus=96, real_memory_mb=1024, gpus=8)}, "nodes.names"),
        ({"nodes": NodeSet(names=["n1"], cpus=0, real_memory_mb=1024, gpus=8)}, "nodes.cpus"),
        ({"nodes": NodeSet(names=["n1"], cpus=96, real_memory_mb=1024, gpus=65)}, "nodes.gpus"),
        ({"partition": "GPU partition"}, "partition"),
        ({"cluster_name": "hvd_dev"}, "cluster_name"),
        ({"controller_address": "hvd-head"}, "controller_address"),
        ({"power": power(suspend_time_s=30)}, "suspend_time_s"),
        ({"state_save_dir": "var/spool"}, "state_save_dir"),
        ({"epilog": "slurm-epilog"}, "epilog"),
        ({"kill_wait_s": 0}, "kill_wait_s"),
        ({"kill_wait_s": MIN_KILL_WAIT_S - 1}, "kill_wait_s"),  # too short for the batch script's closing
        ({"kill_wait_s": 65534}, "kill_wait_s"),
        ({"kill_wait_s": True}, "kill_wait_s"),
        ({"slurmd_timeout_s": 9}, "slurmd_timeout_s"),  # below MessageTimeout
        ({"slurmd_timeout_s": 0}, "slurmd_timeout_s"),  # Slurm's "never": a dead node would hold its job
        ({"unkillable_step_timeout_s": 49}, "unkillable_step_timeout_s"),  # Slurm wants 5 MessageTimeouts
        ({"unkillable_step_timeout_s": "120"}, "unkillable_step_timeout_s"),
    ],
)
def test_slurm_conf_rejects_bad_input(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        slurm_conf(**overrides)


@pytest.mark.parametrize(("gpus", "files"), [(8, "/dev/nvidia[0-7]"), (4, "/dev/nvidia[0-3]"), (1, "/dev/nvidia0")])
def test_gres_conf_names_each_gpu_device(gpus: int, files: str) -> None:
    assert render_gres_conf(gpus) == f"Name=gpu File={files}\n"


def test_gres_conf_needs_gpus() -> None:
    with pytest.raises(ValueError, match="gpus"):
        render_gres_conf(0)


# --- the health check ------------------------------------------------------------------------


GPU_BW_FAILURE = "check_gpu_bw: GPU 1 to GPU 0 failed. Bandwidth 256.63 is less than 335. FaultCode: NHC2020"


def nd_v5_ports(**changed: tuple[str, str]) -> list[tuple[str, ...]]:
    """An ND H100 v5's RDMA ports: the accelerated-networking NIC (Ethernet) and 8 InfiniBand ports ACTIVE
    at 400 Gb/s, but for those changed (device -> (state, rate))."""
    ports: list[tuple[str, ...]] = [("mlx5_an0", "Ethernet", "4: ACTIVE", "100 Gb/sec (2X EDR)")]
    for i in range(8):
        device = f"mlx5_ib{i}"
        ports.append((device, "InfiniBand", *changed.get(device, ("4: ACTIVE", "400 Gb/sec (4X NDR)"))))
    return ports


@dataclass
class Node:
    """A stand-in node: what nvidia-smi, mountpoint, df, sysfs, scontrol and Azure's checks at boot report."""

    sandbox: Sandbox
    gpus: int = 8
    mounted: bool = True
    free_gb: int = 400
    state: str = "IDLE"
    reason: str | None = None
    ports: list[tuple[str, ...]] = field(default_factory=nd_v5_ports)
    azure_checks: str | None = "ok"  # the verdict azure-health-checks left at this boot (None: none)

    def run(self, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
        """Runs the health check; env adds to or (None) removes from the stand-in environment."""
        sandbox, sysfs = self.sandbox, self.sandbox.root / "sys-class-infiniband"
        if not sysfs.exists():
            for port in self.ports:
                add_port(sysfs, *port)
        gpu_lines = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})\\n" for i in range(self.gpus))
        sandbox.stub("nvidia-smi", f'printf "{gpu_lines}"')
        sandbox.stub("mountpoint", "exit 0" if self.mounted else "exit 32")
        sandbox.stub(
            "df",
            "echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
            f"echo '/dev/sda1 999999999 1 {self.free_gb * 1024 * 1024} 1% /'",
        )
        reason = f" Reason={self.reason} [root@2026-01-01T00:00:00]" if self.reason else ""
        shown = f"NodeName=$3 Arch=x86_64 State={self.state} Gres=gpu:8{reason}"
        sandbox.stub("scontrol", f'case "$1 $2" in\n  "show node") echo "{shown}" ;;\nesac')
        script = script_of(node_doc(), HEALTH_CHECK)
        disk = sandbox.root / "docker"
        disk.mkdir(exist_ok=True)
        verdict = sandbox.root / "azure-health-checks-result"
        verdict.unlink(missing_ok=True)
        if self.azure_checks is not None:
            verdict.write_text(f"{self.azure_checks}\n")
        base = {
            "SLURMD_NODENAME": NODE,
            "IB_SYSFS": str(sysfs),
            "AZURE_CHECKS_RESULT": str(verdict),
            "FREE_DISK_PATH": str(disk),
            # Not the default, under the rendered /mnt/shared: the stubs say it is mounted.
            "HEALTH_REPORT_DIR": str(sandbox.root / "health"),
        }
        merged = {key: value for key, value in {**base, **(env or {})}.items() if value is not None}
        return sandbox.run(script, merged)

    def updates(self) -> list[str]:
        return [call for call in self.sandbox.calls("scontrol") if call.startswith("scontrol update")]


@pytest.fixture
def node(sandbox: Sandbox) -> Node:
    return Node(sandbox)


def test_health_check_defaults_are_the_clusters() -> None:
    script = script_of(node_doc(), HEALTH_CHECK)
    defaults = {
        name: re.search(rf"^{name}=\$\{{{name}:-(.*)\}}", script, re.MULTILINE)[1]
        for name in (
            "SHARED_MOUNT",
            "EXPECTED_GPUS",
            "INFINIBAND_PORTS",
            "INFINIBAND_RATE_GBPS",
            "AZURE_CHECKS_RESULT",
            "MIN_FREE_GB",
            "FREE_DISK_PATH",
            "HEALTH_REPORT_DIR",
        )
    }
    assert defaults == {
        "SHARED_MOUNT": "/mnt/shared",
        "EXPECTED_GPUS": "8",
        # ND96isr_H100_v5's, as Azure's conf/nd96isr_h100_v5.conf checks them (infra/health_thresholds.py)
        "INFINIBAND_PORTS": "8",
        "INFINIBAND_RATE_GBPS": "400",
        "AZURE_CHECKS_RESULT": "/run/azure-health-checks/result",
        "MIN_FREE_GB": "50",
        "FREE_DISK_PATH": "/var/lib/docker",
        "HEALTH_REPORT_DIR": f"$SHARED_MOUNT/{HEALTH_REPORT_DIR}",
    }
    # empty in the environment: no Azure checks (the local cluster's rendering has none)
    assert re.search(r"^AZURE_CHECKS_CONF=\$\{AZURE_CHECKS_CONF-(.*)\}", script, re.MULTILINE)[1] == "nd96isr_h100_v5"


@pytest.mark.parametrize("sku", SKUS)
def test_each_sizes_checks_take_its_thresholds_from_the_one_table(sku: str) -> None:
    """The boot run of Azure's checks and the periodic health check read infra/health_thresholds.py."""
    health, files = node_health(sku), files_of(node_doc(sku))
    check, azure = (str(files[path]["content"]) for path in (HEALTH_CHECK, AZURE_CHECKS))
    assert f"INFINIBAND_PORTS=${{INFINIBAND_PORTS:-{health.infiniband_ports}}}" in check.splitlines()
    assert f"INFINIBAND_RATE_GBPS=${{INFINIBAND_RATE_GBPS:-{health.infiniband_rate_gbps}}}" in check.splitlines()
    assert f"AZURE_CHECKS_CONF=${{AZURE_CHECKS_CONF-{health.azure_checks_conf}}}" in check.splitlines()
    assert shell_value(azure, "CONF") == health.azure_checks_conf


def test_the_local_clusters_cpu_nodes_have_no_infiniband_or_azure_checks() -> None:
    check = render_health_check(
        shared_mount="/shared", expected_gpus=0, health=LOCAL_HEALTH, min_free_gb=1, free_disk_path="/shared"
    ).splitlines()
    assert "INFINIBAND_PORTS=${INFINIBAND_PORTS:-0}" in check
    assert "AZURE_CHECKS_CONF=${AZURE_CHECKS_CONF-''}" in check


def test_healthy_node_is_left_alone(node: Node) -> None:
    result = node.run()
    assert result.returncode == 0, result.stderr
    assert node.sandbox.calls("scontrol") == [f"scontrol show node {NODE} --oneliner"]
    assert node.sandbox.calls("mountpoint") == ["mountpoint -q /mnt/shared"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"gpus": 7}, "7 of 8 GPUs"),
        ({"gpus": 0}, "0 of 8 GPUs"),
        ({"mounted": False}, "/mnt/shared not mounted"),
        ({"free_gb": 12}, "12 GB free on {disk}, need 50"),
        # One of the 8 ports down, or come up at a lower rate (HDR on an NDR fabric): Azure's check_hw_ib fails
        # either, and each shows what it found.
        (
            {"ports": nd_v5_ports(mlx5_ib3=("1: DOWN", "10 Gb/sec (4X SDR)"))},
            "7 of 8 InfiniBand ports ACTIVE at 400 Gb/s (mlx5_ib3:1 DOWN)",
        ),
        (
            {"ports": nd_v5_ports(mlx5_ib5=("4: ACTIVE", "200 Gb/sec (4X HDR)"))},
            "7 of 8 InfiniBand ports ACTIVE at 400 Gb/s (mlx5_ib5:1 at 200 Gb/s)",
        ),
        (
            {"ports": nd_v5_ports(mlx5_ib0=("2: INIT", "400 Gb/sec (4X NDR)"), mlx5_ib7=("4: ACTIVE", "unknown"))},
            "6 of 8 InfiniBand ports ACTIVE at 400 Gb/s (mlx5_ib0:1 INIT, mlx5_ib7:1 at an unknown rate)",
        ),
        ({"ports": []}, "0 of 8 InfiniBand ports ACTIVE at 400 Gb/s (none found)"),
        # The accelerated-networking NIC is ACTIVE, but on an Ethernet link layer: no InfiniBand.
        ({"ports": nd_v5_ports()[:1]}, "0 of 8 InfiniBand ports ACTIVE at 400 Gb/s (none found)"),
        # Azure's checks at this boot: the failed check and what it measured, as their run recorded it
        (
            {"azure_checks": f"failed: {GPU_BW_FAILURE}"},
            f"azurehpc-health-checks: {GPU_BW_FAILURE}",
        ),
        (
            {"azure_checks": "failed: azurehpc-health-checks did not finish within 900s"},
            "azurehpc-health-checks: azurehpc-health-checks did not finish within 900s",
        ),
        # Not run at this boot, or running now (an operator's restart): no jobs until they passed.
        ({"azure_checks": None}, "azurehpc-health-checks not run at this boot"),
        (
            {"azure_checks": "running since 2026-01-01T00:00:00Z"},
            "azurehpc-health-checks running since 2026-01-01T00:00:00Z",
        ),
    ],
)
def test_failing_check_drains_the_node_with_the_check_as_reason(
    node: Node, change: dict[str, Any], reason: str
) -> None:
    for key, value in change.items():
        setattr(node, key, value)
    result = node.run()
    assert result.returncode == 1
    expected = f"health-check: {reason.format(disk=node.sandbox.root / 'docker')}"
    assert node.updates() == [f"scontrol update nodename={NODE} state=drain reason={expected}"]
    assert expected in result.stderr


def test_every_failed_check_is_in_the_reason(node: Node) -> None:
    node.gpus, node.mounted, node.ports, node.azure_checks = 6, False, [], "failed: check_gpu_count: 6 of 8"
    assert node.run().returncode == 1
    assert node.updates() == [
        f"scontrol update nodename={NODE} state=drain reason=health-check: 6 of 8 GPUs; "
        "0 of 8 InfiniBand ports ACTIVE at 400 Gb/s (none found); azurehpc-health-checks: check_gpu_count: 6 of 8; "
        "/mnt/shared not mounted"
    ]


def test_a_node_whose_mount_step_failed_is_drained_with_the_steps_reason(node: Node) -> None:
    """The boot's mount step (lustre-mount, nfs-mount) failed: its reason, from node-setup's results, is
    the drain's, so that `status` says why the node takes no jobs."""
    steps = node.sandbox.root / "node-setup"
    steps.mkdir()
    (steps / "packages").write_text("ok\n")
    (steps / "lustre-mount").write_text("failed: lustre-mount: 10.0.3.5@tcp:/lustrefs did not answer within 1200s\n")
    node.mounted = False
    assert node.run({"BOOT_STEPS_DIR": str(steps)}).returncode == 1
    assert node.updates() == [
        f"scontrol update nodename={NODE} state=drain reason=health-check: /mnt/shared not mounted "
        "(failed: lustre-mount: 10.0.3.5@tcp:/lustrefs did not answer within 1200s)"
    ]


def test_where_the_image_has_no_azure_checks_for_the_size_the_node_is_not_drained_for_it(node: Node) -> None:
    """Our own checks stand alone there; the report says why Azure's did not run."""
    node.azure_checks = "skipped: this azurehpc-health-checks has no conf/nd96isr_h200_v5.conf"
    assert node.run().returncode == 0
    assert node.updates() == []


def test_a_node_drained_for_azures_checks_is_resumed_once_a_new_run_passed(node: Node) -> None:
    """`systemctl restart azure-health-checks` on the node (or a new boot): the next health check resumes it."""
    node.state, node.reason = "IDLE+DRAIN", "health-check: azurehpc-health-checks: check_gpu_xid: Xid 79"
    node.azure_checks = "running since 2026-01-01T00:00:00Z"
    assert node.run().returncode == 1
    assert node.updates() == [
        f"scontrol update nodename={NODE} state=drain reason=health-check: azurehpc-health-checks running since "
        "2026-01-01T00:00:00Z"
    ]
    node.reason, node.azure_checks = "health-check: azurehpc-health-checks running since 2026-01-01T00:00:00Z", "ok"
    assert node.run().returncode == 0
    assert node.updates()[-1] == f"scontrol update nodename={NODE} state=resume"


def test_node_drained_by_the_health_check_is_resumed_once_healthy(node: Node) -> None:
    node.state, node.reason = "IDLE+DRAIN", "health-check: 7 of 8 GPUs"
    result = node.run()
    assert result.returncode == 0, result.stderr
    assert node.updates() == [f"scontrol update nodename={NODE} state=resume"]


@pytest.mark.parametrize("healthy", [True, False])
def test_node_drained_by_someone_else_is_left_drained(node: Node, healthy: bool) -> None:
    node.state, node.reason = "IDLE+DRAIN", "replacing a DIMM"
    node.gpus = 8 if healthy else 4
    node.run()
    assert node.updates() == []


@pytest.mark.parametrize("healthy", [True, False])
def test_a_drain_that_lost_its_reason_at_registration_is_ours(node: Node, healthy: bool) -> None:
    """Slurm keeps the drain of the run before a node registers while it holds it powered down (an Azure
    first boot), not its reason: the next run restores the reason, or resumes the node once healthy."""
    node.state, node.reason = "IDLE+CLOUD+DRAIN", None
    node.azure_checks = "ok" if healthy else f"failed: {GPU_BW_FAILURE}"
    node.run()
    if healthy:
        assert node.updates() == [f"scontrol update nodename={NODE} state=resume"]
    else:
        reason = f"health-check: azurehpc-health-checks: {GPU_BW_FAILURE}"
        assert node.updates() == [f"scontrol update nodename={NODE} state=drain reason={reason}"]


def test_unchanged_reason_is_not_rewritten_and_a_new_one_is(node: Node) -> None:
    node.state, node.reason, node.mounted = "IDLE+DRAIN", "health-check: /mnt/shared not mounted", False
    assert node.run().returncode == 1
    assert node.updates() == []
    node.gpus = 7
    node.run()
    assert node.updates() == [
        f"scontrol update nodename={NODE} state=drain reason=health-check: 7 of 8 GPUs; /mnt/shared not mounted"
    ]


def test_local_cluster_settings_come_from_the_environment(node: Node, tmp_path: Path) -> None:
    """CPU nodes, no InfiniBand, a shared directory instead of a mount: the same script, other values."""
    shared = tmp_path / "shared"
    shared.mkdir()
    node.gpus, node.ports, node.mounted, node.azure_checks = 0, [], False, None
    env = {"EXPECTED_GPUS": "0", "INFINIBAND_PORTS": "0", "AZURE_CHECKS_CONF": "", "SHARED_IS_MOUNT": "0",
           "SHARED_MOUNT": str(shared)}  # fmt: skip
    result = node.run(env)
    assert result.returncode == 0, result.stderr
    assert node.sandbox.calls("nvidia-smi") == [] and node.sandbox.calls("mountpoint") == []
    shared.rmdir()
    assert node.run(env).returncode == 1
    assert node.updates() == [
        f"scontrol update nodename={NODE} state=drain reason=health-check: {shared} missing or not writable"
    ]


REPORT_KEYS = ["node", "checked_at", "ok", "gpus", "infiniband", "azure_checks", "shared", "disk", "reason"]


def local_env(shared: Path, **extra: str | None) -> dict[str, str | None]:
    """The local cluster's settings: CPU nodes, no InfiniBand, a shared directory, the report's
    default place (under the shared directory)."""
    return {
        "EXPECTED_GPUS": "0",
        "INFINIBAND_PORTS": "0",
        "AZURE_CHECKS_CONF": "",
        "SHARED_IS_MOUNT": "0",
        "SHARED_MOUNT": str(shared),
        "HEALTH_REPORT_DIR": None,
        **extra,
    }


def read_report(path: Path, *, written_after: datetime) -> dict[str, str]:
    lines = path.read_text().splitlines()
    assert [line.split("=", 1)[0] for line in lines] == REPORT_KEYS
    report = dict(line.split("=", 1) for line in lines)
    checked_at = datetime.strptime(report.pop("checked_at"), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert written_after <= checked_at <= datetime.now(UTC)
    return report


def test_passing_check_reports_ok_in_the_shared_directory(node: Node, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    node.gpus, node.ports, node.mounted = 0, [], False
    node.sandbox.stub("mv", f'exec {shutil.which("mv")} "$@"')  # records the rename, then does it
    before = datetime.now(UTC).replace(microsecond=0)
    result = node.run(local_env(shared))
    assert result.returncode == 0, result.stderr

    reports = shared / HEALTH_REPORT_DIR
    assert [path.name for path in reports.iterdir()] == [NODE]  # no temporary file left
    assert stat.S_IMODE(reports.stat().st_mode) == 0o755
    assert stat.S_IMODE((reports / NODE).stat().st_mode) == 0o644
    assert read_report(reports / NODE, written_after=before) == {
        "node": NODE,
        "ok": "1",
        "gpus": "not checked",
        "infiniband": "not checked",
        "azure_checks": "not checked",
        "shared": "ok",
        "disk": "ok",
        "reason": "",
    }
    # Written beside the report under a temporary name, then renamed over it.
    (move,) = node.sandbox.calls("mv")
    source, target = move.split()[-2:]
    assert Path(source).parent == reports and Path(source).name.startswith(f".{NODE}.")
    assert target == str(reports / NODE)
    assert node.sandbox.calls("scontrol") == [f"scontrol show node {NODE} --oneliner"]


def test_failing_check_is_reported_and_drains_the_node(node: Node, tmp_path: Path) -> None:
    shared, reports = tmp_path / "shared", tmp_path / "reports"  # the shared directory is missing
    node.gpus, node.ports, node.free_gb = 0, [], 12
    before = datetime.now(UTC).replace(microsecond=0)
    result = node.run(local_env(shared, HEALTH_REPORT_DIR=str(reports)))
    assert result.returncode == 1

    disk = f"12 GB free on {node.sandbox.root / 'docker'}, need 50"
    reason = f"health-check: {shared} missing or not writable; {disk}"
    assert node.updates() == [f"scontrol update nodename={NODE} state=drain reason={reason}"]
    assert read_report(reports / NODE, written_after=before) == {
        "node": NODE,
        "ok": "0",
        "gpus": "not checked",
        "infiniband": "not checked",
        "azure_checks": "not checked",
        "shared": f"{shared} missing or not writable",
        "disk": disk,
        "reason": reason,
    }
    # Once healthy again, the report says so and the node is resumed.
    shared.mkdir()
    node.free_gb, node.state, node.reason = 400, "IDLE+DRAIN", reason
    assert node.run(local_env(shared, HEALTH_REPORT_DIR=str(reports))).returncode == 0
    report = read_report(reports / NODE, written_after=before)
    assert (report["ok"], report["shared"], report["disk"], report["reason"]) == ("1", "ok", "ok", "")
    assert node.updates()[-1] == f"scontrol update nodename={NODE} state=resume"


@pytest.mark.parametrize("mounted", [False, True])
def test_no_report_on_a_shared_file_system_that_failed_its_check(node: Node, tmp_path: Path, mounted: bool) -> None:
    """Missing, it would be created on the local disk; unmounted, the report would land under the
    empty mount point (or hang on a dead server). The node is drained all the same."""
    shared = tmp_path / "shared"
    if mounted:  # a mount point with nothing mounted on it
        shared.mkdir()
        env = {"SHARED_MOUNT": str(shared), "HEALTH_REPORT_DIR": None}
        node.mounted = False
    else:
        env = local_env(shared)
    result = node.run(env)
    assert result.returncode == 1
    assert not (shared / HEALTH_REPORT_DIR).exists()
    assert shared.exists() == mounted
    (update,) = node.updates()
    assert update.startswith(f"scontrol update nodename={NODE} state=drain reason=health-check:")


def test_a_report_that_cannot_be_written_never_fails_the_check(node: Node, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = node.run({"HEALTH_REPORT_DIR": str(blocker / "health")})
    assert result.returncode == 0
    assert f"could not write the report in {blocker / 'health'}" in result.stderr
    assert node.updates() == []


def test_health_check_fails_loudly_when_slurm_cannot_be_asked(node: Node) -> None:
    node.run()
    node.sandbox.stub("scontrol", "exit 1")
    env = {"SLURMD_NODENAME": NODE, "HEALTH_REPORT_DIR": str(node.sandbox.root / "health")}
    result = node.sandbox.run(script_of(node_doc(), HEALTH_CHECK), env)
    assert result.returncode == 1
    assert f"cannot read the state of node {NODE}" in result.stderr


def test_health_check_renderer_validates_its_defaults() -> None:
    health = node_health("Standard_ND96isr_H100_v5")
    kwargs = {"shared_mount": "/shared", "expected_gpus": 8, "health": health, "min_free_gb": 50}
    with pytest.raises(ValueError, match="free_disk_path"):
        render_health_check(**kwargs, free_disk_path="var/lib/docker")
    with pytest.raises(ValueError, match="expected_gpus"):
        render_health_check(**{**kwargs, "expected_gpus": -1}, free_disk_path="/var/lib/docker")
    with pytest.raises(ValueError, match="infiniband_ports"):
        render_health_check(**{**kwargs, "health": replace(health, infiniband_ports=-1)}, free_disk_path="/d")
    with pytest.raises(ValueError, match="azure_checks_conf"):
        render_health_check(**{**kwargs, "health": replace(health, azure_checks_conf="../x")}, free_disk_path="/d")


# --- the epilog ----------------------------------------------------------------------------------


@dataclass
class Docker:
    """A stand-in docker whose containers are lines of a file; `rm` takes them away unless stuck."""

    sandbox: Sandbox
    socket_path: Path

    def run(
        self, containers: list[str], *, job: str = "42", ps_fails: bool = False, stuck: bool = False
    ) -> subprocess.CompletedProcess[str]:
        state = self.sandbox.state / "containers"
        state.write_text("".join(f"{c}\n" for c in containers))
        ps = "exit 1" if ps_fails else f'cat "{state}"'
        rm = "exit 1" if stuck else f': >"{state}"'
        self.sandbox.stub("docker", f'case "$1" in\n  ps) {ps} ;;\n  rm) {rm} ;;\nesac')
        return self.sandbox.run(epilog_script(self.sandbox, self.socket_path), {"SLURM_JOB_ID": job})

    def calls(self) -> list[str]:
        return self.sandbox.calls("docker")


def epilog_script(sandbox: Sandbox, socket_path: Path, proc: Path | None = None) -> str:
    """The node's epilog, searching only the sandbox's stubs (and the tools it needs) for commands, and
    ``proc`` for the job's processes (default: an empty directory: this machine's are not the test's)."""
    for tool_name in ("timeout", "cat", "tr", "grep", "seq", "sleep"):
        link = sandbox.bin / tool_name
        if not link.exists():
            link.symlink_to(shutil.which(tool_name) or tool_name)
    if proc is None:
        proc = sandbox.root / "proc"
        proc.mkdir(exist_ok=True)
    script = with_value(script_of(node_doc(), EPILOG), "PATH", str(sandbox.bin))
    return with_value(with_value(script, "DOCKER_SOCKET", str(socket_path)), "PROC", str(proc))


@pytest.fixture
def docker(sandbox: Sandbox) -> Iterator[Docker]:
    path = sandbox.root / "docker.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(path))  # a daemon's socket, as far as `test -S` can tell
        yield Docker(sandbox, path)


def test_prolog_and_epilog_keep_the_dcgm_exporters_job_mapping(tmp_path: Path) -> None:
    """One file per GPU index naming the jobs on it (NVIDIA's --hpc-job-mapping-dir): the prolog adds the job
    to its GPUs' files, the epilog takes it out of every file and leaves the other jobs' lines."""
    mapping, proc = tmp_path / "dcgm-job-map", tmp_path / "proc"
    proc.mkdir()
    scripts = {}
    for name, path in (("prolog", PROLOG), ("epilog", EPILOG)):
        script = with_value(script_of(node_doc(), path), "MAPPING_DIR", str(mapping))
        if name == "epilog":  # no docker daemon, and none of this machine's processes
            script = with_value(with_value(script, "DOCKER_SOCKET", str(tmp_path / "none.sock")), "PROC", str(proc))
        scripts[name] = tmp_path / name
        scripts[name].write_text(script)

    def hook(name: str, job: str, gpus: str = "") -> None:
        env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus}
        done = subprocess.run(["bash", str(scripts[name])], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    hook("prolog", "42", "0,2")
    hook("prolog", "43", "2")  # a GPU shared by two jobs (a GPU is one job's under gres: a stray file's case)
    hook("prolog", "44")  # a job without GPUs labels nothing
    assert {f.name: f.read_text() for f in mapping.iterdir()} == {"0": "42\n", "2": "42\n43\n"}
    hook("epilog", "42")
    assert {f.name: f.read_text() for f in mapping.iterdir()} == {"2": "43\n"}
    hook("epilog", "43")
    assert list(mapping.iterdir()) == []


def test_epilog_removes_the_jobs_containers_and_only_them(docker: Docker) -> None:
    result = docker.run(["c0ffee01", "c0ffee02"], job="4242")
    assert result.returncode == 0, result.stderr
    listing = "docker ps --all --quiet --filter label=slurm.job=4242"
    assert docker.calls() == [listing, "docker rm --force c0ffee01 c0ffee02", listing]
    assert "removed 2 container(s) of job 4242" in result.stderr


def test_epilog_with_nothing_to_remove_only_looks(docker: Docker) -> None:
    result = docker.run([])
    assert result.returncode == 0, result.stderr
    assert docker.calls() == ["docker ps --all --quiet --filter label=slurm.job=42"]


def test_epilog_is_quiet_without_docker_or_its_daemon(docker: Docker) -> None:
    docker.socket_path.unlink()  # the client, but no daemon
    result = docker.run(["c0ffee01"])
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert docker.calls() == []
    (docker.sandbox.bin / "docker").unlink()  # no docker at all
    result = docker.sandbox.run(epilog_script(docker.sandbox, docker.socket_path), {"SLURM_JOB_ID": "42"})
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_epilog_kills_the_processes_of_the_job_that_slurm_lost_and_only_them(docker: Docker) -> None:
    """A process adopted by init (a killed rank's decode worker) with the job's SLURM_JOB_ID; another
    job's process beside it, and one of another cluster's job of the same id (local clusters share the
    machine's process table). Real processes, in this machine's /proc, under a job id nobody else uses."""
    job = str(900_000_000 + os.getpid())
    stray, other, other_cluster = (
        subprocess.Popen(
            ["sleep", "300"],
            env={**os.environ, "SLURM_JOB_ID": job_id, "SLURM_CLUSTER_NAME": cluster},
            start_new_session=True,
        )
        for job_id, cluster in ((job, "ours"), (f"{job}1", "ours"), (job, "theirs"))
    )
    try:
        (docker.sandbox.bin / "docker").unlink(missing_ok=True)  # no docker: processes only
        result = docker.sandbox.run(
            epilog_script(docker.sandbox, docker.socket_path, Path("/proc")),
            {"SLURM_JOB_ID": job, "SLURM_CLUSTER_NAME": "ours"},
        )
        assert result.returncode == 0, result.stderr
        assert stray.wait(timeout=5) == -signal.SIGKILL
        assert other.poll() is None
        assert other_cluster.poll() is None
        assert f"killed 1 process(es) of job {job} that Slurm had lost track of" in result.stderr
    finally:
        for process in (stray, other, other_cluster):
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        ({"ps_fails": True}, "docker did not list the containers of job 42"),
        ({"stuck": True}, "containers of job 42 are still there: c0ffee01 c0ffee02"),
        ({"job": ""}, "SLURM_JOB_ID is '', not a job id"),
        ({"job": "42; reboot"}, "not a job id"),
    ],
)
def test_epilog_fails_so_that_slurm_drains_a_node_it_could_not_clear(
    docker: Docker, failure: dict[str, Any], message: str
) -> None:
    result = docker.run(["c0ffee01", "c0ffee02"], **failure)
    assert result.returncode == 1
    assert message in result.stderr


# --- the power program against a fake Azure ---------------------------------------------------


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    seen: list[str]  # the sandbox's stub calls logged before this request came (FakeAzure.stub_log)


@dataclass
class FakeAzure:
    """IMDS and Resource Manager for the scale sets (on-demand and Spot); `answers` queues (status, body)
    per 'METHOD /suffix'."""

    calls: list[Call] = field(default_factory=list)
    answers: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    endpoint: str = ""
    stub_log: Path | None = None  # a sandbox's calls log: each call records what the stubs had been asked by then

    def answer(self, method: str, path: str) -> tuple[int, Any]:
        if path == "/metadata/identity/oauth2/token":
            return 200, {"access_token": TOKEN, "expires_in": "86399"}
        suffix = path.removeprefix(SPOT_SCALE_SET_ID if path.startswith(SPOT_SCALE_SET_ID) else SCALE_SET_ID)
        queued = self.answers.get(f"{method} {suffix}")
        if queued:
            return queued.pop(0)
        if method == "POST" and suffix in ("/start", "/deallocate"):
            return 202, None
        if method == "GET" and suffix.endswith("/instanceView"):
            return 200, {"statuses": [{"code": "ProvisioningState/succeeded"}, {"code": "PowerState/starting"}]}
        return 404, {"error": {"code": "NotFound", "message": path}}

    def arm_calls(self) -> list[Call]:
        return [call for call in self.calls if call.path.startswith((SCALE_SET_ID, SPOT_SCALE_SET_ID))]


@pytest.fixture
def azure() -> Iterator[FakeAzure]:
    with serving_fake_azure() as fake:
        yield fake


@contextmanager
def serving_fake_azure() -> Iterator[FakeAzure]:
    """The fake Azure on a local HTTP server (the `azure` fixture's; test_release.py's too)."""
    fake = FakeAzure()

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            seen = fake.stub_log.read_text().splitlines() if fake.stub_log else []
            body = json.loads(raw) if raw else None
            fake.calls.append(Call(self.command, url.path, parse_qs(url.query), dict(self.headers), body, seen))
            status, body = fake.answer(self.command, url.path)
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _handle

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as endpoint:
        fake.endpoint = endpoint
        yield fake


def run_power(
    sandbox: Sandbox,
    azure: FakeAzure,
    *argv: str,
    slurm_conf: Path | None = None,
    config: dict[str, Any] | None = None,
    without_slurm: bool = False,
) -> subprocess.CompletedProcess[str]:
    """The power program against the fake Azure, with the head node's power config (and `config`'s
    changes); with slurm_conf, against that real slurmctld instead of a stub scontrol; without_slurm,
    with no scontrol at all (the Slurm packages failed to install)."""
    log = sandbox.root / "power.log"
    config = {
        **json.loads(script_of(head_doc(), POWER_CONFIG_PATH)),
        **(config or {}),
        **{"arm_endpoint": azure.endpoint, "imds_endpoint": azure.endpoint, "retry_seconds": 0, "log_file": str(log)},
        "silence_file": str(silence_file(sandbox)),
    }
    path = sandbox.root / "azure-power.json"
    path.write_text(json.dumps(config))
    if slurm_conf is None and not without_slurm and not (sandbox.bin / "scontrol").exists():
        # scontrol show hostnames: the nodes of a bracketed hostlist are in the state file.
        sandbox.stub(
            "scontrol",
            'if [ "$1 $2" = "show hostnames" ]; then tr "," "\\n" <<<"$3"; fi',
        )
    program = script_of(head_doc(), POWER_PROGRAM_PATH)
    env = {"SLURM_POWER_CONFIG": str(path), **({"SLURM_CONF": str(slurm_conf)} if slurm_conf else {})}
    if without_slurm:
        env["PATH"] = str(sandbox.bin)
    return sandbox.run(program, env, argv=argv, interpreter=sys.executable)


def silence_file(sandbox: Sandbox) -> Path:
    return sandbox.root / "slurmctld-silent-since"


def power_log(sandbox: Sandbox) -> str:
    return (sandbox.root / "power.log").read_text()


def assert_token_kept_secret(sandbox: Sandbox, result: subprocess.CompletedProcess[str]) -> None:
    assert TOKEN not in sandbox.log.read_text()  # no command line
    assert TOKEN not in power_log(sandbox)
    assert TOKEN not in result.stdout + result.stderr


@pytest.mark.parametrize(("action", "verb"), [("suspend", "deallocate"), ("resume", "start")])
def test_power_program_acts_on_the_instances_named_by_the_nodes(
    sandbox: Sandbox, azure: FakeAzure, action: str, verb: str
) -> None:
    nodes = "hvd-gpu-000000,hvd-gpu-000001,hvd-gpu-00000a,hvd-gpu-000010"
    result = run_power(sandbox, azure, action, nodes)
    assert result.returncode == 0, result.stderr + power_log(sandbox)

    imds, arm = azure.calls
    assert imds.headers["Metadata"] == "true"
    assert imds.query["client_id"] == [HEAD_CLIENT_ID] and imds.query["resource"] == [f"{azure.endpoint}/"]
    assert (arm.method, arm.path) == ("POST", f"{SCALE_SET_ID}/{verb}")
    assert arm.query["api-version"] == ["2024-07-01"]
    assert arm.headers["Authorization"] == f"Bearer {TOKEN}"
    # Instance ids are the names' base-36 suffixes.
    assert arm.body == {"instanceIds": ["0", "1", "10", "36"]}
    # resume marks the nodes Slurm started (they keep the autostop time); suspend clears the mark
    comment = "started-by-slurm" if action == "resume" else ""
    assert sandbox.calls("scontrol") == [
        f"scontrol show hostnames {nodes}",
        f"scontrol update nodename={nodes} comment={comment}",
    ]
    assert_token_kept_secret(sandbox, result)


def test_failed_resume_marks_the_nodes_down_at_once(sandbox: Sandbox, azure: FakeAzure) -> None:
    denied = {"error": {"code": "AuthorizationFailed", "message": "no start/action on this scope"}}
    azure.answers["POST /start"] = [(403, denied)]
    result = run_power(sandbox, azure, "resume", "hvd-gpu-000002")
    assert result.returncode == 1
    assert len(azure.arm_calls()) == 1  # a refusal is not retried
    (update,) = [call for call in sandbox.calls("scontrol") if "state=down" in call]
    assert update.startswith("scontrol update nodename=hvd-gpu-000002 state=down reason=resume failed: ")
    assert "HTTP 403 AuthorizationFailed: no start/action on this scope" in update
    assert "AuthorizationFailed" in power_log(sandbox)
    assert_token_kept_secret(sandbox, result)


def test_throttling_and_conflicts_are_retried(sandbox: Sandbox, azure: FakeAzure) -> None:
    busy = {"error": {"code": "OperationNotAllowed", "message": "deallocation in progress"}}
    azure.answers["POST /start"] = [(409, busy), (429, {"error": {"code": "TooManyRequests", "message": "slow"}})]
    result = run_power(sandbox, azure, "resume", "hvd-gpu-000003")
    assert result.returncode == 0, power_log(sandbox)
    assert [call.path for call in azure.arm_calls()] == [f"{SCALE_SET_ID}/start"] * 3


def test_node_of_another_scale_set_is_refused_and_marked_down(sandbox: Sandbox, azure: FakeAzure) -> None:
    result = run_power(sandbox, azure, "resume", "other-000001")
    assert result.returncode == 1
    assert azure.arm_calls() == []
    assert any("state=down" in call and "not a node of this scale set" in call for call in sandbox.calls("scontrol"))


def test_resume_failure_records_azures_view_and_deallocates(sandbox: Sandbox, azure: FakeAzure) -> None:
    failed = {"statuses": [{"code": "ProvisioningState/failed/AllocationFailed"}, {"code": "PowerState/stopped"}]}
    azure.answers["GET /virtualMachines/2/instanceView"] = [(200, failed)]
    result = run_power(sandbox, azure, "resume-fail", "hvd-gpu-000002,hvd-gpu-000003")
    assert result.returncode == 0, power_log(sandbox)
    assert [(call.method, call.path.removeprefix(SCALE_SET_ID)) for call in azure.arm_calls()] == [
        ("GET", "/virtualMachines/2/instanceView"),
        ("GET", "/virtualMachines/3/instanceView"),
        ("POST", "/deallocate"),
    ]
    assert azure.arm_calls()[-1].body == {"instanceIds": ["2", "3"]}
    updates = [call for call in sandbox.calls("scontrol") if "update" in call]
    assert updates == [
        "scontrol update nodename=hvd-gpu-000002 state=down "
        "reason=resume timed out: ProvisioningState/failed/AllocationFailed, PowerState/stopped",
        "scontrol update nodename=hvd-gpu-000003 state=down "
        "reason=resume timed out: ProvisioningState/succeeded, PowerState/starting",
    ]


def test_power_program_survives_slurmctlds_closed_descriptors(sandbox: Sandbox, azure: FakeAzure) -> None:
    """slurmctld closes stdin, stdout and stderr before it runs the program."""
    run_power(sandbox, azure, "suspend", "hvd-gpu-000000")  # writes the config and stubs
    azure.calls.clear()
    config, program = sandbox.root / "azure-power.json", sandbox.root / "slurm-power"
    program.write_text(script_of(head_doc(), POWER_PROGRAM_PATH))
    result = sandbox.run(
        f'exec 0<&- 1>&- 2>&-\nexec "{sys.executable}" "{program}" suspend hvd-gpu-000001\n',
        {"SLURM_POWER_CONFIG": str(config)},
    )
    assert result.returncode == 0
    assert azure.arm_calls()[0].body == {"instanceIds": ["1"]}
    assert "deallocating hvd-gpu-000001" in power_log(sandbox)


def test_power_program_runs_on_the_python_of_ubuntu_2204(sandbox: Sandbox, azure: FakeAzure) -> None:
    """The head node's python3 is 3.10, which has no datetime.UTC (3.11): here, it is taken away."""
    run_power(sandbox, azure, "reboot", "hvd-gpu-000000")  # writes the config and stubs
    program = sandbox.root / "slurm-power"
    program.write_text(script_of(head_doc(), POWER_PROGRAM_PATH))
    as_on_3_10 = f"import datetime, runpy\ndel datetime.UTC\nrunpy.run_path({str(program)!r}, run_name='__main__')\n"
    result = sandbox.run(as_on_3_10, argv=["usage"], interpreter=sys.executable)
    assert result.returncode == 2 and "usage:" in result.stderr, result.stderr


def test_power_program_usage(sandbox: Sandbox, azure: FakeAzure) -> None:
    result = run_power(sandbox, azure, "reboot", "hvd-gpu-000000")
    assert result.returncode == 2
    assert "suspend|resume|resume-fail" in result.stderr and "reap" in result.stderr
    assert azure.calls == []


# --- the reaper: nodes that Azure runs and Slurm holds as powered down --------------------------


def started(minutes_ago: float, power: str = "running") -> dict[str, Any]:
    """An instance view as Azure writes it: the last provisioning operation's time, in 100 ns digits."""
    when = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    stamp = when.strftime("%Y-%m-%dT%H:%M:%S.%f") + "1+00:00"
    return {
        "statuses": [
            {"code": "ProvisioningState/succeeded", "time": stamp},
            {"code": f"PowerState/{power}"},
        ]
    }


def shown(node: str, state: str, comment: str = "", reason: str = "") -> str:
    """A node as `scontrol --oneliner show node` prints it: the fields the power program reads, a comment
    only where one is set, and a reason (free text, last)."""
    note = f" Comment={comment}" if comment else ""
    return f"NodeName={node} Arch=x86_64 State={state}{note} Reason={reason or 'none'} State=BOGUS\n"


def stub_slurm(sandbox: Sandbox, nodes: str, later: str | None = None, pending: str = "") -> None:
    """scontrol lists `nodes` (shown() lines), and `later` when asked again about some of them; squeue
    lists the `pending` job ids; scontrol update only logs its call."""
    for name, text in (("nodes", nodes), ("nodes-later", nodes if later is None else later), ("pending", pending)):
        (sandbox.state / name).write_text(text)
    sandbox.stub(
        "scontrol",
        'case "$*" in\n'
        '  "show hostnames "*) tr "," "\\n" <<<"$3" ;;\n'
        '  "--oneliner show node") cat "$STUB_STATE/nodes" ;;\n'
        '  "--oneliner show node "*) cat "$STUB_STATE/nodes-later" ;;\n'
        "esac",
    )
    sandbox.stub("squeue", 'cat "$STUB_STATE/pending"')


def test_reap_deallocates_only_nodes_running_unregistered_past_the_bound(sandbox: Sandbox, azure: FakeAzure) -> None:
    stub_slurm(
        sandbox,
        # 000003 registered and runs a job; 000004 is being powered up by Slurm; 000005 is on its way down
        shown("hvd-gpu-000000", "IDLE+CLOUD+POWERED_DOWN")
        + shown("hvd-gpu-000001", "IDLE+CLOUD+POWERED_DOWN")
        + shown("hvd-gpu-000002", "DOWN+CLOUD+POWERED_DOWN", reason="resume timed out: State=x")
        + shown("hvd-gpu-000003", "MIXED+CLOUD")
        + shown("hvd-gpu-000004", "IDLE+CLOUD+POWERED_DOWN+POWERING_UP")
        + shown("hvd-gpu-000005", "IDLE+CLOUD+POWERED_DOWN+POWERING_DOWN")
        + shown("hvd-gpu-000006", "IDLE+CLOUD+POWERED_DOWN"),
    )
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(45))]
    azure.answers["GET /virtualMachines/1/instanceView"] = [(200, started(5))]  # still within the bound
    azure.answers["GET /virtualMachines/2/instanceView"] = [(200, started(300, power="deallocated"))]
    # shut down from inside, still allocated to its host: Azure bills it as if it ran
    azure.answers["GET /virtualMachines/6/instanceView"] = [(200, started(50, power="stopped"))]
    result = run_power(sandbox, azure, "reap")
    assert result.returncode == 0, result.stderr + power_log(sandbox)
    assert [(call.method, call.path.removeprefix(SCALE_SET_ID)) for call in azure.arm_calls()] == [
        ("GET", "/virtualMachines/0/instanceView"),
        ("GET", "/virtualMachines/1/instanceView"),
        ("GET", "/virtualMachines/2/instanceView"),
        ("GET", "/virtualMachines/6/instanceView"),
        ("POST", "/deallocate"),
    ]
    assert azure.arm_calls()[-1].body == {"instanceIds": ["0", "6"]}
    assert [call for call in sandbox.calls("scontrol") if "update" in call] == [
        "scontrol update nodename=hvd-gpu-000000 state=down reason=not registered 45 min after its start: "
        "deallocated (ProvisioningState/succeeded, PowerState/running)",
        "scontrol update nodename=hvd-gpu-000006 state=down reason=not registered 50 min after its start: "
        "deallocated (ProvisioningState/succeeded, PowerState/stopped)",
    ]
    assert "hvd-gpu-000000 not registered 45 min after its start" in power_log(sandbox)
    assert_token_kept_secret(sandbox, result)


def test_reap_leaves_a_node_that_slurm_began_to_resume(sandbox: Sandbox, azure: FakeAzure) -> None:
    stub_slurm(
        sandbox,
        shown("hvd-gpu-000000", "IDLE+CLOUD+POWERED_DOWN"),
        later=shown("hvd-gpu-000000", "IDLE+CLOUD+POWERED_DOWN+POWERING_UP"),
    )
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(45))]
    result = run_power(sandbox, azure, "reap")
    assert result.returncode == 0, power_log(sandbox)
    assert [call.method for call in azure.arm_calls()] == ["GET"]
    assert not [call for call in sandbox.calls("scontrol") if "update" in call]


def test_reap_goes_on_past_an_instance_azure_cannot_show(sandbox: Sandbox, azure: FakeAzure) -> None:
    stub_slurm(
        sandbox, shown("hvd-gpu-000000", "IDLE+CLOUD+POWERED_DOWN") + shown("hvd-gpu-000001", "IDLE+CLOUD+POWERED_DOWN")
    )
    azure.answers["GET /virtualMachines/0/instanceView"] = [(404, {"error": {"code": "NotFound", "message": "gone"}})]
    azure.answers["GET /virtualMachines/1/instanceView"] = [(200, started(31))]
    result = run_power(sandbox, azure, "reap")
    assert result.returncode == 0, power_log(sandbox)
    assert azure.arm_calls()[-1].body == {"instanceIds": ["1"]}
    assert "hvd-gpu-000000: no instance view: GET" in power_log(sandbox)


@pytest.mark.parametrize(
    ("comment", "pending", "expected"),
    [
        ("", "", ["scontrol update nodename=hvd-gpu-000000,hvd-gpu-000002 state=power_down"]),
        ("started-by-slurm", "", ["scontrol update nodename=hvd-gpu-000002 state=power_down"]),
        ("", "42\n", []),  # a job waits: Slurm may give it these nodes
    ],
    ids=["came-up-on-their-own", "one-started-for-a-job", "a-job-waits"],
)
def test_reap_powers_down_at_once_idle_nodes_that_came_up_outside_slurm(
    sandbox: Sandbox, azure: FakeAzure, comment: str, pending: str, expected: list[str]
) -> None:
    """Registered, idle and not started by Slurm (the scale set's creation starts every instance): powered
    down through Slurm (its SuspendProgram deallocates them) at once, not after the autostop time."""
    stub_slurm(
        sandbox,
        shown("hvd-gpu-000000", "IDLE+CLOUD", comment=comment)
        + shown("hvd-gpu-000001", "MIXED+CLOUD")  # a job runs there
        + shown("hvd-gpu-000002", "IDLE+CLOUD")
        + shown("hvd-gpu-000003", "IDLE+DRAIN+CLOUD", reason="operator: bad DIMM")
        + shown("hvd-gpu-000004", "IDLE+CLOUD+PLANNED"),  # the backfill scheduler holds it for a job
        pending=pending,
    )
    result = run_power(sandbox, azure, "reap")
    assert result.returncode == 0, result.stderr + power_log(sandbox)
    assert [call for call in sandbox.calls("scontrol") if "update" in call] == expected
    assert azure.arm_calls() == []  # Slurm powers them down, through the SuspendProgram


def test_reap_leaves_idle_nodes_up_when_autostop_is_off(sandbox: Sandbox, azure: FakeAzure) -> None:
    stub_slurm(sandbox, shown("hvd-gpu-000000", "IDLE+CLOUD"))
    result = run_power(sandbox, azure, "reap", config={"power_down_unused": False})
    assert result.returncode == 0, power_log(sandbox)
    assert [call for call in sandbox.calls("scontrol") if "update" in call] == []


def test_reap_powers_down_through_slurm_the_lost_nodes_that_azure_deallocated(
    sandbox: Sandbox, azure: FakeAzure
) -> None:
    """A Spot eviction that the node's agent missed: Azure deallocated the instance, Slurm lost its slurmd
    and holds it DOWN for ever (it never suspends a node it believes on). The reaper asks Azure for each
    DOWN node's state and powers the deallocated ones down through Slurm, which starts them again for
    the next job; a lost node that Azure still runs, and a node an operator drained, are left."""
    stub_slurm(
        sandbox,
        shown("hvd-gpu-000000", "DOWN+CLOUD+NOT_RESPONDING", reason="Not responding")
        + shown("hvd-gpu-000001", "DOWN+DRAIN+CLOUD+NOT_RESPONDING", reason="spot eviction 4F2A")  # 1 s notice
        + shown("hvd-gpu-000002", "DOWN+CLOUD+NOT_RESPONDING", reason="Not responding")  # Azure runs it
        + shown("hvd-gpu-000003", "DOWN+DRAIN+CLOUD+NOT_RESPONDING", reason="operator: bad DIMM")
        + shown("hvd-gpu-000004", "MIXED+CLOUD")
        # not given up yet (SlurmdTimeout): Slurm's own node-failure handling (the requeue) goes first
        + shown("hvd-gpu-000005", "MIXED+CLOUD+NOT_RESPONDING"),
    )
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(3, power="deallocated"))]
    azure.answers["GET /virtualMachines/1/instanceView"] = [(200, started(3, power="deallocating"))]
    azure.answers["GET /virtualMachines/2/instanceView"] = [(200, started(3, power="running"))]
    result = run_power(sandbox, azure, "reap")
    assert result.returncode == 0, result.stderr + power_log(sandbox)
    assert [(call.method, call.path.removeprefix(SCALE_SET_ID)) for call in azure.arm_calls()] == [
        ("GET", f"/virtualMachines/{instance}/instanceView") for instance in (0, 1, 2)
    ]  # Slurm's SuspendProgram deallocates them (again), not the reaper
    updates = [call for call in sandbox.calls("scontrol") if "update" in call]
    assert updates == [
        f"scontrol update nodename=hvd-gpu-00000{n} state=power_down_force reason=spot eviction or stop outside "
        f"Slurm: Azure deallocated it (ProvisioningState/succeeded, PowerState/{power})"
        for n, power in ((0, "deallocated"), (1, "deallocating"))
    ]
    assert "hvd-gpu-000000 lost by Slurm (CLOUD+DOWN+NOT_RESPONDING)" in power_log(sandbox)
    assert_token_kept_secret(sandbox, result)


# --- the reaper without slurmctld: Slurm failed on the head node -------------------------------


def silent_for(sandbox: Sandbox, seconds: float) -> None:
    """As if the reaper had first found slurmctld silent `seconds` ago."""
    since = time.time() - seconds
    silence_file(sandbox).touch()
    os.utime(silence_file(sandbox), (since, since))


def conf_of_a_stopped_controller(tmp_path: Path) -> Path:
    """The Azure slurm.conf, for a slurmctld that does not run (its port on loopback is free)."""
    conf = tmp_path / "slurm.conf"
    rendered = slurm_conf(controller_host="head", controller_address="127.0.0.1")
    conf.write_text(override(rendered, {"SlurmctldPort": str(free_port()), "MessageTimeout": "2"}))
    return conf


@pytest.mark.parametrize("broken", ["slurmctld does not run", "Slurm is not installed"])
def test_reap_without_slurmctld_deallocates_every_instance_once_the_grace_has_passed(
    sandbox: Sandbox, azure: FakeAzure, tmp_path: Path, broken: str
) -> None:
    """Nothing vouches for any instance: the first round that finds slurmctld silent starts the count and
    deallocates nothing; once the grace has passed since then, every round deallocates every instance of
    both scale sets through Azure alone (instanceIds omitted), and power.log says why."""
    spot = {"scale_set_id": SPOT_SCALE_SET_ID, "node_prefix": "hvd-spot-", "identity_client_id": CLIENT_ID}
    config = {"controller_grace_s": 3600, "spot": spot}
    if broken == "slurmctld does not run":
        options: dict[str, Any] = {"slurm_conf": conf_of_a_stopped_controller(tmp_path)}
    else:
        options = {"without_slurm": True}

    first = run_power(sandbox, azure, "reap", config=config, **options)
    assert first.returncode == 0, first.stderr + power_log(sandbox)
    assert azure.arm_calls() == [] and silence_file(sandbox).exists()
    assert "slurmctld does not answer (" in power_log(sandbox)
    assert "silent for 0 min; every instance is deallocated at 60 min" in power_log(sandbox)

    silent_for(sandbox, 3600)
    later = run_power(sandbox, azure, "reap", config=config, **options)
    assert later.returncode == 0, later.stderr + power_log(sandbox)
    assert [(call.method, call.path, call.body) for call in azure.arm_calls()] == [
        ("POST", f"{SCALE_SET_ID}/deallocate", {}),
        ("POST", f"{SPOT_SCALE_SET_ID}/deallocate", {}),
    ]
    for scale_set in ("vmss-1", "vmss-spot"):
        assert f"deallocating every instance of {scale_set}" in power_log(sandbox)
    assert "slurmctld has not answered for 60 min (" in power_log(sandbox)
    assert_token_kept_secret(sandbox, later)


def test_reap_with_slurmctld_answering_again_ends_the_silence(sandbox: Sandbox, azure: FakeAzure) -> None:
    """slurmctld answers: the round is the usual one (a node it vouches for is not deallocated, whatever
    the silence before), and the count starts anew at its next silence."""
    silent_for(sandbox, 7200)
    stub_slurm(sandbox, shown("hvd-gpu-000000", "IDLE+CLOUD+POWERED_DOWN") + shown("hvd-gpu-000001", "MIXED+CLOUD"))
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(5))]  # within the bound
    result = run_power(sandbox, azure, "reap", config={"controller_grace_s": 3600})
    assert result.returncode == 0, result.stderr + power_log(sandbox)
    assert [(call.method, call.path.removeprefix(SCALE_SET_ID)) for call in azure.arm_calls()] == [
        ("GET", "/virtualMachines/0/instanceView")
    ]
    assert not silence_file(sandbox).exists()


@dataclass
class Controller:
    """A real slurmctld (with its munged) for the Azure-rendered slurm.conf, on loopback, no slurmd."""

    conf: Path

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    if os.geteuid() != 0:
        pytest.fail("a real slurmctld needs root here (its own hostname through unshare), as the local cluster does")
    root = tmp_path / "ctld"
    (root / "state").mkdir(parents=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = root / "munge.socket"
    azure_conf = slurm_conf(
        controller_host="head",
        controller_address="127.0.0.1",
        nodes=NodeSet(names=["hvd-gpu-000000", "hvd-gpu-000001"], cpus=2, real_memory_mb=1024, gpus=0),
        state_save_dir=str(root / "state"),
        epilog=None,
    )
    conf = override(
        azure_conf,
        {
            # what 25.11 does by default and this machine's 22.05 only when asked (dtrain/local/slurm_conf.py)
            "PrivateData": PRIVATE_DATA,
            "SlurmctldParameters": f"{conf_value(azure_conf, 'SlurmctldParameters')},{CLOUD_REG_ADDRS}",
            "SlurmUser": "root",
            "AuthInfo": f"socket={socket_path}",
            "SlurmctldPort": str(free_port()),
            "SlurmdPort": str(free_port()),
            "SlurmctldPidFile": str(root / "slurmctld.pid"),
            "MailProg": "/bin/true",
        },
    )
    # The reaper's test runs no slurmdbd, which slurmctld refuses to start without when slurm.conf names one
    # (Azure's accounting runs for real in tests/scripts/test_azure_slurm_files.py): no Accounting* line.
    conf = "".join(line for line in conf.splitlines(keepends=True) if not line.startswith("Accounting"))
    (root / "slurm.conf").write_text(conf)
    munge_argv = [tool("munged"), "--foreground", f"--key-file={key}", f"--socket={socket_path}"]
    munge_argv += [f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munged.seed'}", "--force"]
    ctld_argv = ["unshare", "--uts", "sh", "-c", f'hostname head && exec {tool("slurmctld")} -D -f "$0"']
    with open(root / "daemons.log", "wb") as log:
        daemons = [subprocess.Popen(munge_argv, stdout=log, stderr=log)]
        try:
            wait_until(lambda: socket_path.exists(), "munged's socket")
            daemons.append(subprocess.Popen([*ctld_argv, str(root / "slurm.conf")], stdout=log, stderr=log))
            ctld = Controller(root / "slurm.conf")
            wait_until(lambda: ctld.run("scontrol", "ping").returncode == 0, "slurmctld answers")
            yield ctld
        finally:
            for daemon in reversed(daemons):
                daemon.terminate()
                daemon.wait(timeout=30)


def wait_until(probe: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.2)


def test_unregistered_node_is_deallocated_and_status_says_so(
    sandbox: Sandbox, azure: FakeAzure, controller: Controller
) -> None:
    """A real slurmctld holds both CLOUD nodes as powered down (neither slurmd ever registered), while
    Azure runs one of them since its first boot 40 minutes ago: that one is deallocated and DOWN with
    the reason, and `status` shows it powered down with that reason; the other, off in Azure, is left."""
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(40))]
    azure.answers["GET /virtualMachines/1/instanceView"] = [(200, started(40, power="deallocated"))]
    result = run_power(sandbox, azure, "reap", slurm_conf=controller.conf)
    assert result.returncode == 0, result.stderr + power_log(sandbox)
    assert azure.arm_calls()[-1].body == {"instanceIds": ["0"]}

    text = controller.run("sinfo", *shlex.split(NODE_FIELDS)).stdout
    nodes = {node.name: node for node in parse_nodes(text)}
    reaped, off = nodes["hvd-gpu-000000"], nodes["hvd-gpu-000001"]
    assert (reaped.base_state, reaped.powered_down, reaped.unregistered) == ("down", True, True)
    assert reaped.reason.startswith("not registered 40 min after its start: deallocated (ProvisioningState/")
    assert (off.base_state, off.powered_down, off.unregistered) == ("idle", True, False)
    table = render_table(nodes_table(list(nodes.values()), {}, {}))
    assert "deallocated, never registered" in table and "not registered 40 min after its start" in table
    assert "2 powered down (1 deallocated, never registered)" in summary(list(nodes.values()), [])
    # `cost --live` counts it apart, at $0, beside the power-saved one
    cfg = parse_config({**VALID_CONFIG, "nodeCount": "2", "namePrefix": "hvd"}, PROJECT)
    rows = {row.item: row for row in estimate_cost(cfg, load_price_table(), live=count_nodes(cfg, nodes.values())).rows}
    assert [
        (rows[item].count, rows[item].usd_per_hour) for item in ("GPU nodes, running", "GPU nodes, power-saved")
    ] == [
        (0, 0),
        (1, 0),
    ]
    assert rows["GPU nodes, never registered"].count == 1 and rows["GPU nodes, never registered"].usd_per_hour == 0
    # the next round finds it off in Azure and leaves it be
    azure.calls.clear()
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(0, power="deallocated"))]
    azure.answers["GET /virtualMachines/1/instanceView"] = [(200, started(40, power="deallocated"))]
    assert run_power(sandbox, azure, "reap", slurm_conf=controller.conf).returncode == 0
    assert [call.method for call in azure.arm_calls()] == ["GET", "GET"]


def test_resume_marks_the_nodes_it_starts_and_suspend_clears_the_mark(
    sandbox: Sandbox, azure: FakeAzure, controller: Controller
) -> None:
    """The comment survives in a real slurmctld (a reason would not survive registration)."""

    def comment() -> str:
        shown = controller.run("scontrol", "--oneliner", "show", "node", "hvd-gpu-000001").stdout
        return shown.split(" Comment=", 1)[1].split()[0] if " Comment=" in shown else ""  # shown only when set

    assert run_power(sandbox, azure, "resume", "hvd-gpu-000001", slurm_conf=controller.conf).returncode == 0
    assert comment() == "started-by-slurm"
    assert run_power(sandbox, azure, "suspend", "hvd-gpu-000001", slurm_conf=controller.conf).returncode == 0
    assert comment() == ""
    assert "could not set the comment" not in power_log(sandbox)


def render_table(table: Any) -> str:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


# --- the head node's cloud-config --------------------------------------------------------------


def test_head_node_installs_the_controller_and_its_files() -> None:
    document = head_doc()
    parsed = yaml.safe_load(document)
    assert "packages" not in parsed  # head-setup's first step installs them, at every run until they are there
    assert setup_packages(document) == [
        "nfs-common",
        "munge",
        "slurm-smd=25.11.5-*",
        "slurm-smd-client=25.11.5-*",  # sbatch and friends: the head node is the login node
        "slurm-smd-slurmctld=25.11.5-*",
        "slurm-smd-slurmdbd=25.11.5-*",  # accounting: at slurmctld's version (infra/cloud_init/accounting.py)
        "mariadb-server",  # slurmdbd's database, on the head node's own disk
        "prometheus",  # the cluster's telemetry (infra/cloud_init/prometheus.py)
        "python3-venv",  # the MLflow server's environment (infra/cloud_init/mlflow.py)
    ]
    files = files_of(document)
    for path, expected in (
        ("/etc/slurm/slurm.conf", slurm_conf()),
        ("/etc/slurm/gres.conf", render_gres_conf(8)),
        ("/etc/slurm/cgroup.conf", render_cgroup_conf()),  # served to the nodes' slurmd (configless)
    ):
        assert files[path]["content"] == expected
        assert (files[path]["defer"], files[path]["owner"], files[path]["permissions"]) == (True, "root:root", "0644")
    # the timer that deallocates unregistered nodes is on before head-setup.service, which runs head-setup
    # at every boot until it has succeeded (tests/infra/test_boot_steps.py), and may fail or wait
    assert parsed["runcmd"] == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", "slurm-power-reap.timer"],
        ["systemctl", "try-reload-or-restart", "ssh"],  # the people's keys (tests/infra/test_users.py)
        ["systemctl", "enable", "--now", "--no-block", "head-setup.service"],
        *mlflow_commands(),  # tests/infra/test_mlflow_server.py
    ]
    assert "ExecStart=/usr/local/sbin/head-setup" in files["/etc/systemd/system/head-setup.service"]["content"]


def test_no_munge_key_in_either_document_only_the_program_that_fetches_it() -> None:
    for document, client_id in ((head_doc(), HEAD_CLIENT_ID), (node_doc(), CLIENT_ID)):
        assert MUNGE_KEY_PATH not in files_of(document)
        fetch = files_of(document)[MUNGE_KEY_FETCH_PATH]
        assert (fetch["owner"], fetch["permissions"]) == ("root:root", "0755")
        script = fetch["content"]
        assert shell_value(script, "VAULT_URI") == KEY_VAULT_URI and shell_value(script, "KEY_PATH") == MUNGE_KEY_PATH
        assert shell_value(script, "SECRET_NAME") == "slurm-munge-key"
        assert shell_value(script, "IDENTITY_CLIENT_ID") == client_id  # each machine's own identity


class KeyVault(BaseHTTPRequestHandler):
    """IMDS and the Key Vault data plane in one: tokens for vault.azure.net, the secret for that token."""

    secret = base64.b64encode(b"K" * 1024).decode()
    refuse = 0  # answer this many secret reads 403, as before a new role assignment propagates

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/metadata/identity/oauth2/token":
            ok = query["resource"] == ["https://vault.azure.net"] and query["client_id"] == [CLIENT_ID]
            self._reply(200 if ok else 400, {"access_token": TOKEN} if ok else {"error": "invalid_request"})
        elif url.path == "/secrets/slurm-munge-key" and self.headers.get("Authorization") == f"Bearer {TOKEN}":
            if KeyVault.refuse > 0:
                KeyVault.refuse -= 1
                self._reply(403, {"error": {"code": "Forbidden"}})
            else:
                self._reply(200, {"value": KeyVault.secret})
        else:
            self._reply(401, {"error": {"code": "Unauthorized"}})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        reply_json(self, status, body)

    def log_message(self, *args: object) -> None:
        pass


NEVER = 1_000_000  # more refusals than any retry window makes requests


@pytest.mark.parametrize(("refused", "written"), [(0, True), (1, True), (NEVER, False)])
def test_munge_key_comes_from_key_vault_with_the_nodes_identity(sandbox: Sandbox, refused: int, written: bool) -> None:
    """Retries while the role assignment propagates; writes the key 0400 for munge; the token never
    reaches argv (curl reads the header from stdin) and neither does the key."""
    KeyVault.refuse = refused
    key_path = sandbox.root / "munge.key"
    sandbox.stub("chown")
    sandbox.stub("curl", 'echo "curl-argv $*" >>"$STUB_STATE/argv"; exec /usr/bin/curl "$@"')
    with serving(KeyVault) as endpoint:
        script = with_value(script_of(node_doc(), MUNGE_KEY_FETCH_PATH), "VAULT_URI", endpoint)
        script = with_value(script, "KEY_PATH", str(key_path))
        # refused for good: it gives up once the next attempt would come after the 2 s allowed (after one
        # attempt or more: how many depends on the machine's speed); refused once or never: time enough
        # for the second attempt however slow the machine
        retry_for = "2" if not written else "60"
        env = {"IMDS_ENDPOINT": f"{endpoint}/metadata/identity/oauth2/token", "MUNGE_KEY_RETRY_FOR_SECONDS": retry_for}
        result = sandbox.run(script, {**env, "MUNGE_KEY_RETRY_SECONDS": "1"})
    assert (result.returncode == 0) is written, result.stderr
    if refused:  # why it waits is in the log: Key Vault's answer while the role assignment propagates
        assert "returned error: 403" in result.stderr and "Traceback" not in result.stderr
        assert ("retrying in 1s" if written else "giving up after 2s") in result.stderr
    assert TOKEN not in (sandbox.state / "argv").read_text() + result.stdout + result.stderr
    assert KeyVault.secret not in result.stdout + result.stderr
    if written:
        assert key_path.read_bytes() == b"K" * 1024 and stat.S_IMODE(key_path.stat().st_mode) == 0o400
        assert sandbox.calls("chown")[-1].startswith("chown munge:munge ")
    else:
        assert not key_path.exists() and not list(sandbox.root.glob("munge.key.*"))
        assert "could not read secret slurm-munge-key" in result.stderr


def test_the_reaper_runs_every_5_minutes_as_slurm_through_the_power_program() -> None:
    files = files_of(head_doc())
    service = files["/etc/systemd/system/slurm-power-reap.service"]["content"]
    timer = files["/etc/systemd/system/slurm-power-reap.timer"]["content"]
    assert f"ExecStart={POWER_PROGRAM_PATH} reap" in service.splitlines()
    assert "User=slurm" in service.splitlines() and "Type=oneshot" in service.splitlines()
    assert {"OnBootSec=5min", "OnUnitActiveSec=5min", "WantedBy=timers.target"} <= set(timer.splitlines())


def test_the_reaper_runs_without_slurm_on_the_head_node(tmp_path: Path) -> None:
    """It must deallocate the nodes when Slurm failed on the head node: its timer is enabled by cloud-init,
    not by head-setup (which starts slurmctld); neither unit needs or binds to slurmctld; it runs as an
    account made before any package; and the directories it writes in are its service's own."""
    parsed = yaml.safe_load(head_doc())
    files = files_of(head_doc())
    assert ["systemctl", "enable", "--now", REAP_UNITS[1]] in parsed["runcmd"]
    assert "slurm-power" not in files[HEAD_SETUP_PATH]["content"]
    units = {unit: files[f"{UNITS_DIR}/{unit}"]["content"].splitlines() for unit in REAP_UNITS}
    for lines in units.values():
        assert not [line for line in lines if line.startswith(("Requires=", "BindsTo=", "Requisite=", "PartOf="))]
    service = units[REAP_UNITS[0]]
    assert f"User={SLURM_USER}" in service and account_commands() == parsed["bootcmd"]
    assert {"LogsDirectory=slurm", "RuntimeDirectory=slurm-power", "RuntimeDirectoryPreserve=yes"} <= set(service)
    assert Path(POWER_LOG_PATH).parent == Path("/var/log/slurm")
    assert Path(SILENCE_FILE_PATH).parent == Path("/run/slurm-power")
    for unit, lines in units.items():
        (tmp_path / unit).write_text("\n".join(lines).replace(f"ExecStart={POWER_PROGRAM_PATH}", "ExecStart=/bin/true"))
    result = systemd_verify(tmp_path, list(REAP_UNITS))
    assert not [line for line in result.stderr.splitlines() if "slurm-power" in line], result.stderr


def test_power_programs_are_wrappers_of_the_one_program() -> None:
    files = files_of(head_doc())
    for path, action in POWER_ACTIONS.items():
        assert files[path]["permissions"] == "0755"
        assert files[path]["content"].splitlines()[-1] == f'exec {POWER_PROGRAM_PATH} {action} "$@"'
    program = files[POWER_PROGRAM_PATH]["content"]
    assert program.startswith("#!/usr/bin/python3\n")
    assert f'"SLURM_POWER_CONFIG", "{POWER_CONFIG_PATH}"' in program
    assert json.loads(files[POWER_CONFIG_PATH]["content"]) == {
        "scale_set_id": SCALE_SET_ID,
        "identity_client_id": HEAD_CLIENT_ID,
        "node_prefix": "hvd-gpu-",
        "log_file": POWER_LOG_PATH,
        "register_timeout_s": 1800,
        "controller_grace_s": 3600,
        "silence_file": SILENCE_FILE_PATH,
        "power_down_unused": True,
    }


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"scale_set_id": "vmss-1"}, "scale_set_id"),
        ({"scale_set_id": f"{SCALE_SET_ID}?api-version=1"}, "scale_set_id"),
        ({"node_prefix": "HVD-GPU-"}, "node_prefix"),
        ({"identity_client_id": "/subscriptions/x"}, "identity_client_id"),
        ({"slurm_conf": "ClusterName=hvd"}, "slurm_conf"),
        ({"key_vault_uri": "http://kv.vault.azure.net/"}, "key_vault_uri"),
        ({"shared": NfsShare("nfs", "/export")}, "nfs_server_ip"),
        ({"shared": LustreShare("lustre.internal")}, "lustre_mgs_address"),
        ({"admin_user": "Admin"}, "admin_user"),
        ({"admin_user": "hpc admin"}, "admin_user"),
        ({"admin_user": ""}, "admin_user"),
    ],
)
def test_head_node_rejects_bad_input(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        head_doc(**overrides)
