"""Slurm's files on the local cluster: where they live (SlurmFiles), the slurm.conf that
infra/cloud_init/slurm.py renders for Azure with this machine's changes (`render_local_conf`), and the
daemons' command lines. Runs on the operator's machine, as root; dtrain/local/slurm.py starts the daemons.

Debian 12's Slurm is 22.05, where Azure's hosts run Microsoft's 25.11 (Debian's archive has no 25.11
to build from; docs/infrastructure.md, "Slurm version and where it comes from"). The file is Azure's
but for the settings named in `render_local_conf`: this machine's paths and accounts, the two that
22.05 needs for what 23.11 does by default (CLOUD_REG_ADDRS, PRIVATE_DATA), process tracking and usage
gathering (/proc), and munged's socket for slurmdbd (dtrain/local/accounting.py runs it beside slurmctld).
"""

from __future__ import annotations

import hashlib
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import OperatorError
from dtrain.fileio import atomic_write
from infra.cloud_init.slurm import (
    MIN_KILL_WAIT_S,
    HealthCheck,
    JobTimeLimits,
    NodeSet,
    PowerSaving,
    partition_line,
    render_health_check,
    render_slurm_conf,
)
from infra.contract import HEALTH_REPORT_DIR, SLURM_PARTITION, SPOT_PARTITION
from infra.health_thresholds import LOCAL_HEALTH

CONTROLLER_HOST = "head"
NODE_CPUS = 2  # what each node offers to jobs: every node shares this machine's cores
NODE_MEMORY_MB = 2048
MIN_FREE_GB = 1
RUNTIME_ROOT = Path("/run/hvd-local")
SBIN = "/usr/sbin"
# Azure's Prolog and Epilog, run in place (through wrappers that name the node's GPU job mapping): they
# keep the GPUs' job mapping for the GPU stand-in's hpc_job label, and the epilog removes a job's
# containers (there are none with the host runtime)
SLURM_SCRIPTS = Path(__file__).resolve().parents[1] / "remote" / "slurm"
TELEMETRY = "telemetry"  # STATE/telemetry/<node>: node_exporter's textfile directory (dtrain/local/telemetry.py)
JOB_MAP = "hpc-jobs"  # in it: the job mapping, one file per GPU index (the DCGM exporter's --hpc-job-mapping-dir)
POWER_ACTIONS = ("suspend", "resume", "resume-fail")  # dtrain/local/power.py
# Shorter than on Azure, where a VM boots in minutes: here a node is two processes.
SUSPEND_TIMEOUT_S = 5  # a suspended node may be resumed this long after its suspend began
RESUME_TIMEOUT_S = 60
POWER_SAVE_INTERVAL_S = 2  # how often slurmctld looks for nodes to suspend (Slurm's default: 10)
SLURMD_TIMEOUT_S = 10  # a node whose slurmd stops answering is DOWN after this long
# SIGTERM to SIGKILL, on cancel and at the time limit: the batch script's closing, on a loaded machine
KILL_WAIT_S = MIN_KILL_WAIT_S
RENDERER_MIN_S = 60  # the shortest SuspendTime and HealthCheckInterval infra's renderer accepts
# A job that names no --time ends after an hour (nothing here runs for long); none is capped.
JOB_TIME = JobTimeLimits(default="1:00:00")
# What Slurm 23.11 and later do for cloud nodes by default and 22.05 only when asked (both are gone
# from 25.11's slurm.conf): learn a node's address when it registers (its name is in no DNS), and
# show powered-down nodes in sinfo.
CLOUD_REG_ADDRS = "cloud_reg_addrs"  # a SlurmctldParameters option
PRIVATE_DATA = "cloud"


@dataclass(frozen=True)
class LocalSlurmSettings:
    """What the operator chooses for the local Slurm (`local up` flags)."""

    autostop_s: int = 0  # idle seconds before a node is suspended (SuspendTime); 0: never
    health_check_interval_s: int = 60
    gpus_per_node: int = 0  # emulated GPUs (dtrain/local/gpus.py): gres, isolated by task/cgroup


@dataclass(frozen=True)
class SlurmFiles:
    """Where everything of the local Slurm lives: under the cluster's state directory, but for the
    sockets. A UNIX socket's path holds at most 107 bytes, and slurmstepd names one per job step in
    the spool directory (`<spool>/<node>/<node>_<job>.<step>`): under a deep state directory (a pytest
    temporary directory, a clone in a long home path) steps would fail to start. So the spool
    directories and munged's socket live in a short runtime directory, /run/hvd-local/<hash of the
    state directory>, which `down` removes."""

    state_dir: Path

    @property
    def runtime(self) -> Path:
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
        return RUNTIME_ROOT / digest

    @property
    def root(self) -> Path:
        return self.state_dir / "slurm"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def state_save(self) -> Path:
        return self.root / "slurmctld"

    @property
    def spool(self) -> Path:
        return self.runtime / "spool"  # one directory per node below it (%n)

    def telemetry(self, node: str) -> Path:
        """The node's telemetry directory: its exporter's textfile collector reads it."""
        return self.state_dir / TELEMETRY / node

    def job_map(self, node: str) -> Path:
        """The node's GPU job mapping (what slurm-prolog.sh writes on Azure's /run/dcgm-job-map)."""
        return self.telemetry(node) / JOB_MAP

    def hook(self, name: str) -> Path:
        """The wrapper slurmd runs as the prolog or epilog."""
        return self.root / name

    @property
    def health_check(self) -> Path:
        return self.root / "health-check"

    def power_program(self, action: str) -> Path:
        """The wrapper slurmctld runs to suspend, resume (or give up resuming) nodes."""
        return self.root / action

    @property
    def munge(self) -> Path:
        return self.state_dir / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.runtime / "munge.socket"

    def make_dirs(self, nodes: Sequence[str]) -> None:
        for directory in (self.state_save, *(self.spool / node for node in nodes)):
            directory.mkdir(parents=True, exist_ok=True)
        # munged wants its socket's directory open to every user
        for directory in (self.munge, self.runtime):
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            directory.chmod(0o755)


def client_env(conf: str | Path) -> dict[str, str]:
    """The environment the Slurm commands (sinfo, srun, sbatch, ...) need on the host."""
    return {"SLURM_CONF": str(conf)}


def write_config(
    files: SlurmFiles,
    cluster: str,
    controller_address: str,
    nodes: Sequence[str],
    shared: Path,
    settings: LocalSlurmSettings,
) -> None:
    """slurm.conf, cgroup.conf, the health check and the munge key."""
    try:
        conf = render_local_conf(files, cluster, controller_address, nodes, settings)
        check = render_health_check(
            shared_mount=str(shared),
            expected_gpus=0,
            health=LOCAL_HEALTH,  # CPU nodes: no InfiniBand, no Azure checks
            min_free_gb=MIN_FREE_GB,
            free_disk_path=str(shared),
        )
    except ValueError as exc:  # a state directory whose path slurm.conf cannot carry, say
        raise OperatorError(f"cannot configure Slurm for the local cluster: {exc}") from None
    atomic_write(files.conf, conf)
    # slurmd reads cgroup.conf beside slurm.conf. Its default, autodetect, fails inside a network
    # namespace (`ip netns exec` mounts a fresh /sys without /sys/fs/cgroup); v1 is only loaded, never
    # used: processes are tracked through /proc (proctrack/linuxproc).
    atomic_write(files.conf.with_name("cgroup.conf"), "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
    script = files.root / "slurm-health-check.sh"
    atomic_write(script, check, 0o755)
    # slurmd runs its HealthCheckProgram with SLURMD_NODENAME alone in the environment: the wrapper
    # adds what differs here (a plain shared directory, this cluster's slurm.conf for scontrol, and
    # where the node's last result goes, as on Azure: the shared file system's .health directory).
    wrapper = (
        "#!/bin/sh\n"
        f"export SLURM_CONF={shlex.quote(str(files.conf))} SHARED_IS_MOUNT=0 "
        f"HEALTH_REPORT_DIR={shlex.quote(str(shared / HEALTH_REPORT_DIR))}\n"
        f"exec {shlex.quote(str(script))}\n"
    )
    atomic_write(files.health_check, wrapper, 0o755)
    # slurmd runs them in the node's namespaces, with SLURMD_NODENAME: the node's own job mapping, as
    # /run/dcgm-job-map is each Azure node's own
    # and the node's textfile directory (the gate's figures), and this cluster's slurm.conf (the epilog
    # drains a node that failed a job's gate)
    textfiles = f'{shlex.quote(str(files.state_dir / TELEMETRY))}/"$SLURMD_NODENAME"'
    hook_env = f"DCGM_HPC_JOB_MAPPING_DIR={textfiles}/{JOB_MAP} NODE_TEXTFILE_DIR={textfiles}"
    hook_env += f" SLURM_CONF={shlex.quote(str(files.conf))}"
    for hook in ("prolog", "epilog"):
        script = SLURM_SCRIPTS / f"slurm-{hook}.sh"
        hook_wrapper = f"#!/bin/sh\nexport {hook_env}\nexec {shlex.quote(str(script))}\n"
        atomic_write(files.hook(hook), hook_wrapper, 0o755)
    atomic_write(files.munge_key, os.urandom(1024), 0o400)  # a fresh key per cluster, root's only


def render_local_conf(
    files: SlurmFiles, cluster: str, controller_address: str, nodes: Sequence[str], settings: LocalSlurmSettings
) -> str:
    """Azure's slurm.conf (infra's renderer) with what one machine of namespaces needs instead."""
    autostop = settings.autostop_s > 0
    node_set = NodeSet(names=list(nodes), cpus=NODE_CPUS, real_memory_mb=NODE_MEMORY_MB, gpus=settings.gpus_per_node)
    azure = render_slurm_conf(
        cluster_name=cluster,
        controller_host=CONTROLLER_HOST,
        controller_address=controller_address,
        partition=SLURM_PARTITION,
        nodes=node_set,
        state_save_dir=str(files.state_save),
        slurmd_spool_dir=str(files.spool),
        power=PowerSaving(
            suspend_program=str(files.power_program("suspend")),
            resume_program=str(files.power_program("resume")),
            resume_fail_program=str(files.power_program("resume-fail")),
            # seconds here, where the renderer wants minutes' worth: replaced below
            suspend_time_s=RENDERER_MIN_S if autostop else None,
            suspend_timeout_s=SUSPEND_TIMEOUT_S,
            resume_timeout_s=RESUME_TIMEOUT_S,
        ),
        health_check=HealthCheck(program=str(files.health_check), interval_s=RENDERER_MIN_S),
        prolog=str(files.hook("prolog")),
        epilog=str(files.hook("epilog")),
        kill_wait_s=KILL_WAIT_S,
        slurmd_timeout_s=SLURMD_TIMEOUT_S,
        job_time=JOB_TIME,
    )
    run = files.root
    controller = conf_value(azure, "SlurmctldParameters")
    # Every node is in the Spot partition too: any of them may be "evicted" (dtrain/local/metadata.py)
    spot = partition_line(SPOT_PARTITION, "ALL", node_set, default=False, job_time=JOB_TIME)
    conf = override(
        azure,
        {
            "SlurmUser": "root",  # every local daemon runs as root, which owns the state directory
            "AuthInfo": f"socket={files.munge_socket}",
            # every node shares one machine: its own spool and pid file (%n: the node's name)
            "SlurmdSpoolDir": f"{files.spool}/%n",
            "SlurmdPidFile": f"{run}/slurmd-%n.pid",
            "SlurmctldPidFile": f"{run}/slurmctld.pid",
            # the nodes advertise NODE_CPUS whatever this machine has
            "SlurmdParameters": "config_overrides",
            # binding tasks to "their" cores would pin every node's tasks to the same few cores; with
            # emulated GPUs, task/cgroup constrains each job to its own GPUs' devices (ConstrainDevices)
            "TaskPlugin": "task/cgroup" if settings.gpus_per_node else "task/none",
            "MailProg": "/bin/true",  # Debian's default, /usr/bin/mail, is not installed
            "SlurmctldParameters": f"{controller},{CLOUD_REG_ADDRS},power_save_interval={POWER_SAVE_INTERVAL_S}",
            "PrivateData": PRIVATE_DATA,
            # a node's namespaces have no freezer or cpuset hierarchy (only the devices one, for
            # emulated GPUs): processes are tracked through /proc
            "ProctrackType": "proctrack/linuxproc",
            "HealthCheckInterval": str(settings.health_check_interval_s),
            # slurmctld and the commands authenticate to slurmdbd through munged's socket: with munge,
            # AccountingStoragePass names it (Azure's is at munge's default path)
            "AccountingStoragePass": str(files.munge_socket),
            # a step's usage from /proc, as processes are tracked (no cgroup hierarchy in a node's namespaces)
            "JobAcctGatherType": "jobacct_gather/linux",
            **({"SuspendTime": str(settings.autostop_s)} if autostop else {}),
        },
    )
    return conf + spot + "\n"


def conf_value(conf: str, key: str) -> str:
    """The value of a `Key=value` line of conf."""
    for line in conf.splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1]
    raise ValueError(f"{key} is not set in the rendered slurm.conf")


def override(conf: str, settings: dict[str, str]) -> str:
    """conf with each `Key=value` line of settings replaced in place, or appended when absent."""
    pending = dict(settings)
    lines = []
    for line in conf.splitlines():
        key = line.split("=", 1)[0] if "=" in line and not line.startswith("#") else None
        lines.append(f"{key}={pending.pop(key)}" if key in pending else line)
    lines += ["# the local cluster's own settings", *(f"{key}={value}" for key, value in pending.items())]
    return "\n".join(lines) + "\n"


# --- the daemons' command lines ----------------------------------------------------------------
def munged_argv(files: SlurmFiles) -> list[str]:
    munge = files.munge
    return [
        f"{SBIN}/munged",
        "--foreground",  # logs to stderr (the log file under STATE/logs), stays our child
        f"--key-file={files.munge_key}",
        f"--socket={files.munge_socket}",
        f"--pid-file={munge / 'munged.pid'}",
        f"--seed-file={munge / 'munged.seed'}",
        # munged refuses a socket below a directory that not every user may enter (pytest's 0700
        # temporary directories): --force lets it serve; every client here is root anyway
        "--force",
    ]


def slurmctld_argv(namespace: str, conf: Path, etc: Path | None = None) -> list[str]:
    """slurmctld in the head namespace, with the hostname slurm.conf's SlurmctldHost names (it refuses
    to run on any other host). etc: the head's own /etc (dtrain/local/accounts.py), whose accounts it
    resolves a job's user in; None: this machine's."""
    bind = 'mount --bind "$1" /etc && ' if etc else ""
    script = f'hostname {CONTROLLER_HOST} && {bind}exec {SBIN}/slurmctld -D -f "$0"'
    argv = ["ip", "netns", "exec", namespace, "unshare", "--uts", "--mount", "sh", "-c", script, str(conf)]
    return argv + ([str(etc)] if etc else [])


def slurmd_argv(node_init_pid: int, node: str, conf: Path) -> list[str]:
    """slurmd inside the namespaces of the node's first process (its sshd).

    -b: the node reports that it booted when its slurmd started. slurmctld ignores a resumed node
    until it registers with a boot time after the resume request, and this machine's uptime is
    older than any request."""
    enter = ["nsenter", f"--target={node_init_pid}", "--net", "--uts", "--pid", "--mount"]
    return [*enter, f"{SBIN}/slurmd", "-D", "-b", "-f", str(conf), "-N", node]


def slurmd_role(node: str) -> str:
    """The name of a node's slurmd in the cluster's records and logs (STATE/logs/<role>.log)."""
    return f"slurmd-{node}"
