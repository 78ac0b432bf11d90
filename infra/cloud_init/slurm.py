"""slurm.conf, gres.conf and cgroup.conf, rendered by pure functions from plain values.

Written for the Slurm that Azure's hosts install (slurm_packages.py: 25.11 by default, 23.11 at the
oldest), and checked against 25.11's tables of keys (tests/infra/data/slurm-25.11-keys.json). The
local cluster runs Debian 12's Slurm 22.05 on the same files, with the few settings in which 22.05
differs put back by dtrain/local/slurm_conf.py. Nothing here is Azure's: the caller names the nodes,
their resources and the programs that power them down and up.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from infra.cloud_init._common import check_int, check_ipv4, check_path, render_script
from infra.cloud_init.azure_checks import AZURE_CHECKS_RESULT, check_conf_name
from infra.cloud_init.slurm_packages import SLURM_USER
from infra.contract import (
    HEALTH_REPORT_DIR,
    LAUNCH_END_WAIT_S,
    MIN_CLOSING_S,
    SLURMCTLD_PORT,
    SLURMD_PORT,
    SLURMDBD_PORT,
    SPOT_PARTITION,
    SRUN_PORTS,
)
from infra.health_thresholds import NodeHealth
from infra.slurm_time import DEFAULT_JOB_TIME, UNLIMITED, check_max_time, check_time_limit, exceeds

# Slurm compares names case-sensitively while DNS does not: lower case keeps the two agreeing.
_NAME = re.compile(r"[a-z][a-z0-9-]{0,62}")
MAX_GPUS_PER_NODE = 64
MAX_INFINIBAND_PORTS = 64
MAX_CPUS_PER_NODE = 4096
MAX_REAL_MEMORY_MB = 2**31 - 1
# Slurm forwards messages through a tree of slurmds, which must then resolve each other's names.
# Cloud nodes are not in DNS under their Slurm names, so slurmctld talks to every node itself
# (the widest tree Slurm allows; the scale set holds at most 100 nodes).
TREE_WIDTH = 65533
# Slurm reads these timeouts as 16-bit numbers.
MAX_TIMEOUT_S = 65533
# Slurm's MessageTimeout, which this file leaves at its default: no node can be judged dead, nor a
# process unkillable, sooner than a message to its slurmd may take.
MESSAGE_TIMEOUT_S = 10
# Seconds between SIGTERM and SIGKILL when a job is cancelled or runs out of time: the batch script
# closes the run in that window (docs/operator.md, "When a job ends"): the launcher's last lines, then
# status, run.json, MLflow and the upload of logs, outputs and the last checkpoint, over the storage
# service endpoint. A job that ends at once on SIGTERM holds its nodes no longer for it.
KILL_WAIT_S = 120
MIN_KILL_WAIT_S = LAUNCH_END_WAIT_S + MIN_CLOSING_S
# How long slurmctld waits for a silent slurmd before it marks the node DOWN (and requeues its
# jobs, those submitted with --requeue). Slurm's default; an Azure node under load, or a brief
# network blip, must not lose its job.
SLURMD_TIMEOUT_S = 300
# Multifactor priority: a pending job's priority is mostly its account's fair share (what the account
# used this month against its share), then how long it has waited (a tenth as much, full after a week), so
# that a team's light users are not queued behind its heavy ones.
PRIORITY_WEIGHT_FAIRSHARE = 10000
PRIORITY_WEIGHT_AGE = 1000
# The usage that fair share and the people's GPU-hour budgets (GrpTRESMins, infra/users.py) count: each
# month's, from the 1st at 00:00, not decayed. A decaying usage would make a budget a rolling allowance
# that refills by itself; Slurm's docs ask for no decay with a reset period for hard limits like these.
PRIORITY_DECAY_HALF_LIFE = "0"
PRIORITY_USAGE_RESET_PERIOD = "MONTHLY"
# Minutes between two tallies of the running jobs' usage into it: what a budget's `used` lags by.
PRIORITY_CALC_PERIOD_MIN = 1
# After SIGKILL, how long a step's processes may linger (a process stuck in I/O on a hard NFS
# mount) before the node is drained as unhealthy. Slurm wants at least 5 MessageTimeouts.
UNKILLABLE_STEP_TIMEOUT_S = 120


@dataclass(frozen=True)
class NodeSet:
    """Identical nodes: their Slurm names and what each offers to jobs."""

    names: Sequence[str]
    cpus: int
    real_memory_mb: int
    gpus: int  # 0: no GPUs, no GRES (CPU nodes)


@dataclass(frozen=True)
class PowerSaving:
    """Slurm's power saving: idle nodes are suspended by one program and resumed by another."""

    suspend_program: str
    resume_program: str
    resume_fail_program: str
    suspend_time_s: int | None  # idle seconds before a node is suspended; None: never
    suspend_timeout_s: int  # how long a suspend may take before the node can be resumed again
    resume_timeout_s: int  # how long a node may take to boot and register before it is marked DOWN


@dataclass(frozen=True)
class JobTimeLimits:
    """Every partition's DefaultTime (a job that names no --time: an sbatch or salloc by hand; `launch`
    always names one) and MaxTime (the longest a job may ask for; INFINITE: no cap), in Slurm's time
    syntax. Checked when made: a finite default, no longer than the maximum."""

    default: str = DEFAULT_JOB_TIME
    maximum: str = UNLIMITED

    def __post_init__(self) -> None:
        for key, check in (("default", check_time_limit), ("maximum", check_max_time)):
            value = getattr(self, key)
            try:
                if not isinstance(value, str):
                    raise ValueError("a time limit is text")
                object.__setattr__(self, key, check(value))  # as slurm.conf writes it: INFINITE for UNLIMITED
            except ValueError as exc:
                raise ValueError(f"job_time.{key}: {value!r}: {exc}") from None
        if exceeds(self.default, self.maximum):
            raise ValueError(f"job_time.default: {self.default} is longer than job_time.maximum {self.maximum}")


@dataclass(frozen=True)
class HealthCheck:
    program: str  # run by slurmd as root on every node
    interval_s: int


def check_name(key: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{key}: {value!r} is not a lower-case name of letters, digits and '-' (at most 63)")
    return value


def _check_nodes(nodes: NodeSet) -> None:
    names = [check_name("nodes.names", name) for name in nodes.names]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"nodes.names: {names!r} must be one or more distinct names")
    check_int("nodes.cpus", nodes.cpus, 1, MAX_CPUS_PER_NODE)
    check_int("nodes.real_memory_mb", nodes.real_memory_mb, 1, MAX_REAL_MEMORY_MB)
    check_int("nodes.gpus", nodes.gpus, 0, MAX_GPUS_PER_NODE)


def _power_lines(power: PowerSaving, partitions: Sequence[str]) -> list[str]:
    for key in ("suspend_program", "resume_program", "resume_fail_program"):
        check_path(f"power.{key}", getattr(power, key))
    suspend_timeout = check_int("power.suspend_timeout_s", power.suspend_timeout_s, 1, MAX_TIMEOUT_S)
    resume_timeout = check_int("power.resume_timeout_s", power.resume_timeout_s, 1, MAX_TIMEOUT_S)
    if power.suspend_time_s is None:
        # SuspendTime=INFINITE would switch the whole power-save module off, and with it the
        # resuming of nodes that are powered down (deallocated earlier): keep the module on (any
        # other SuspendTime; this sum is Slurm's advised minimum) and exclude the partition instead.
        idle = [f"SuspendExcParts={','.join(partitions)}", f"SuspendTime={suspend_timeout + resume_timeout}"]
    else:
        idle = [f"SuspendTime={check_int('power.suspend_time_s', power.suspend_time_s, 60, 2**31 - 1)}"]
    return [
        f"SuspendProgram={power.suspend_program}",
        f"ResumeProgram={power.resume_program}",
        f"ResumeFailProgram={power.resume_fail_program}",
        *idle,
        f"SuspendTimeout={suspend_timeout}",
        f"ResumeTimeout={resume_timeout}",
    ]


def _job_lines(
    *, kill_wait_s: int, slurmd_timeout_s: int, unkillable_step_timeout_s: int, prolog: str | None, epilog: str | None
) -> list[str]:
    """How jobs start and end: the prolog, signals, timeouts, requeueing and the epilog."""
    return [
        # A job goes back to the queue after a node failure only when submitted with --requeue:
        # one that cannot resume from a checkpoint would otherwise start over unasked.
        "JobRequeue=0",
        f"KillWait={check_int('kill_wait_s', kill_wait_s, MIN_KILL_WAIT_S, MAX_TIMEOUT_S)}",
        f"SlurmdTimeout={check_int('slurmd_timeout_s', slurmd_timeout_s, MESSAGE_TIMEOUT_S, MAX_TIMEOUT_S)}",
        "UnkillableStepTimeout="
        f"{check_int('unkillable_step_timeout_s', unkillable_step_timeout_s, 5 * MESSAGE_TIMEOUT_S, MAX_TIMEOUT_S)}",
        # Run by slurmd as root on every node of the allocation as the job starts (Alloc: on every node
        # at once, not at each node's first step) and once it has ended.
        *([f"Prolog={check_path('prolog', prolog)}", "PrologFlags=Alloc"] if prolog is not None else []),
        *([f"Epilog={check_path('epilog', epilog)}"] if epilog is not None else []),
    ]


def _accounting_lines(accounting_address: str) -> list[str]:
    """Every job's record to slurmdbd (infra/cloud_init/accounting.py), its GPUs among the TRES counted, and
    the scheduling that the records make possible: limits per association and QOS, and fair share."""
    return [
        # slurmctld sends each job's start, end and allocation to slurmdbd (beside it on the head node),
        # and keeps them in StateSaveLocation while slurmdbd does not answer: none is lost
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={check_ipv4('accounting_address', accounting_address)}",
        f"AccountingStoragePort={SLURMDBD_PORT}",
        # GPUs are counted (AllocTRES gres/gpu=N in sacct and squeue), beside Slurm's default TRES
        "AccountingStorageTRES=gres/gpu",
        # a job runs only under a known cluster/account/user association, within its limits and QOS; and
        # (safe) starts against a GPU-hour budget only if its time limit x GPUs fits in what is left, rather
        # than being killed once the budget runs out under it
        "AccountingStorageEnforce=associations,limits,qos,safe",
        # each step's CPU time and memory, read from the job's cgroup (sacct MaxRSS, TotalCPU)
        "JobAcctGatherType=jobacct_gather/cgroup",
        "PriorityType=priority/multifactor",
        f"PriorityWeightFairshare={PRIORITY_WEIGHT_FAIRSHARE}",
        f"PriorityWeightAge={PRIORITY_WEIGHT_AGE}",
        f"PriorityDecayHalfLife={PRIORITY_DECAY_HALF_LIFE}",
        f"PriorityUsageResetPeriod={PRIORITY_USAGE_RESET_PERIOD}",
        f"PriorityCalcPeriod={PRIORITY_CALC_PERIOD_MIN}",
    ]


def render_slurm_conf(
    *,
    cluster_name: str,
    controller_host: str,
    controller_address: str,
    partition: str,
    nodes: NodeSet,
    state_save_dir: str,
    slurmd_spool_dir: str,
    power: PowerSaving,
    health_check: HealthCheck,
    prolog: str | None = None,
    epilog: str | None = None,
    kill_wait_s: int = KILL_WAIT_S,
    slurmd_timeout_s: int = SLURMD_TIMEOUT_S,
    unkillable_step_timeout_s: int = UNKILLABLE_STEP_TIMEOUT_S,
    spot_nodes: NodeSet | None = None,
    job_time: JobTimeLimits,
) -> str:
    """slurm.conf for one controller and a partition of identical, power-managed nodes, and with
    spot_nodes a second one of Spot nodes (contract.SPOT_PARTITION), powered the same way. Accounting
    goes to slurmdbd beside the controller, at controller_address (infra/cloud_init/accounting.py).

    prolog and epilog: the programs slurmd runs before and after each job (None: none). The timeouts are in seconds:
    kill_wait_s from SIGTERM to SIGKILL (at least MIN_KILL_WAIT_S: the batch script closes the run in
    it), slurmd_timeout_s before a silent node is DOWN (at least MessageTimeout, 10),
    unkillable_step_timeout_s after SIGKILL before a node with processes left is drained (at least 50);
    each at most 65533. job_time: every partition's
    DefaultTime and MaxTime.
    """
    node_sets = [nodes, *([spot_nodes] if spot_nodes else [])]
    _check_node_sets(node_sets)
    check_name("partition", partition)
    partitions = [partition, *([SPOT_PARTITION] if spot_nodes else [])]
    lines = [
        "# Rendered by infra/cloud_init/slurm.py for Slurm 23.11 and later (25.11 by default).",
        *_controller_lines(
            cluster_name=cluster_name,
            controller_host=controller_host,
            controller_address=controller_address,
            state_save_dir=state_save_dir,
            slurmd_spool_dir=slurmd_spool_dir,
        ),
        *_scheduling_lines(),
        # slurmdbd runs beside slurmctld, on the controller's address
        *_accounting_lines(controller_address),
        *_job_lines(
            kill_wait_s=kill_wait_s,
            slurmd_timeout_s=slurmd_timeout_s,
            unkillable_step_timeout_s=unkillable_step_timeout_s,
            prolog=prolog,
            epilog=epilog,
        ),
        *(["GresTypes=gpu"] if any(node_set.gpus for node_set in node_sets) else []),
        f"HealthCheckProgram={check_path('health_check.program', health_check.program)}",
        f"HealthCheckInterval={check_int('health_check.interval_s', health_check.interval_s, 60, 86400)}",
        "HealthCheckNodeState=ANY",
        *_power_lines(power, partitions),
        # CLOUD: power-managed nodes, taken as powered down until their slurmd registers.
        *(_node_line(node_set) for node_set in node_sets),
        *_partition_lines(partition, nodes, spot_nodes, job_time),
    ]
    return "\n".join(lines) + "\n"


def _check_node_sets(node_sets: Sequence[NodeSet]) -> None:
    for node_set in node_sets:
        _check_nodes(node_set)
    names = [name for node_set in node_sets for name in node_set.names]
    if len(set(names)) != len(names):
        raise ValueError("spot_nodes: their names must differ from the on-demand nodes' names")


def _controller_lines(
    *, cluster_name: str, controller_host: str, controller_address: str, state_save_dir: str, slurmd_spool_dir: str
) -> list[str]:
    """Who the controller is, how daemons reach and trust each other, and where they keep state."""
    return [
        f"ClusterName={check_name('cluster_name', cluster_name)}",
        f"SlurmctldHost={check_name('controller_host', controller_host)}"
        f"({check_ipv4('controller_address', controller_address)})",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        # A fixed range, so that the network rules can name srun's ports.
        f"SrunPortRange={SRUN_PORTS}",
        f"SlurmUser={SLURM_USER}",
        # munge: what Azure's stacks use, and the local cluster's Slurm 22.05 has no auth/slurm.
        "AuthType=auth/munge",
        f"StateSaveLocation={check_path('state_save_dir', state_save_dir)}",
        f"SlurmdSpoolDir={check_path('slurmd_spool_dir', slurmd_spool_dir)}",
        # configless: slurmd fetches this file (and gres.conf, cgroup.conf) from slurmctld, so they
        # live only on the controller. idle_on_node_suspend: a node that was DOWN or drained is
        # idle again once powered down, so that it is tried afresh. Since 23.11 slurmctld learns a
        # cloud node's address when it registers, and sinfo shows powered-down cloud nodes, by
        # default (cloud_reg_addrs and PrivateData=cloud are gone).
        "SlurmctldParameters=enable_configless,idle_on_node_suspend",
        f"TreeWidth={TREE_WIDTH}",
        # A node marked DOWN (by a resume that timed out, say) rejoins once its slurmd registers.
        "ReturnToService=2",
    ]


def _scheduling_lines() -> list[str]:
    """How processes are tracked and resources handed out: the same on every cluster."""
    return [
        # A job's processes are the members of its cgroup (none escapes by daemonizing), and each
        # job is confined to its cores, memory and GPUs' device files (cgroup.conf): two jobs
        # sharing a node cannot touch each other's GPUs. Tasks are not bound to cores by default:
        # launchers pin their own ranks. Memory is consumable (CR_Core_Memory), or cgroup.conf's
        # ConstrainRAMSpace would hold each job to nothing less than the node's whole RealMemory;
        # each partition gives a job that names no --mem its share (_default_shares).
        "ProctrackType=proctrack/cgroup",
        "TaskPlugin=task/cgroup,task/affinity",
        "TaskPluginParam=None",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "MpiDefault=none",
        # A job's supplementary groups are read on its node, not on the controller: docker-runtime
        # jobs need the admin user's membership of the nodes' docker group (node-setup.sh), which
        # the head node, without docker, does not have (and a group's number differs between hosts).
        "LaunchParameters=disable_send_gids",
        # A job that no partition it names allows (a --time above MaxTime, say) is refused at
        # submission instead of pending for ever. ANY, not ALL: `launch --spot-fallback` names two
        # partitions of different sizes, and fitting one of them is enough.
        "EnforcePartLimits=ANY",
    ]


def _partition_lines(partition: str, nodes: NodeSet, spot_nodes: NodeSet | None, job_time: JobTimeLimits) -> list[str]:
    """The default partition (every node, or the on-demand ones beside Spot's) and the Spot partition."""
    if spot_nodes is None:
        return [partition_line(partition, "ALL", nodes, default=True, job_time=job_time)]
    return [
        partition_line(partition, ",".join(nodes.names), nodes, default=True, job_time=job_time),
        partition_line(SPOT_PARTITION, ",".join(spot_nodes.names), spot_nodes, default=False, job_time=job_time),
    ]


def _node_line(nodes: NodeSet) -> str:
    line = f"NodeName={','.join(nodes.names)} CPUs={nodes.cpus} RealMemory={nodes.real_memory_mb}"
    return line + (f" Gres=gpu:{nodes.gpus}" if nodes.gpus else "") + " State=CLOUD"


def _default_shares(nodes: NodeSet) -> str:
    """What a job that names no --cpus-per-gpu or --mem gets of a node: with each GPU, its share of the
    node's cores (for its data loaders) and of its memory; on CPU nodes, each core's share of the memory.
    A job asking for every GPU thus gets all but a rounding of the memory; whole-node jobs ask --mem=0."""
    if not nodes.gpus:
        return f" DefMemPerCPU={nodes.real_memory_mb // nodes.cpus}"
    return f" DefCpuPerGPU={max(1, nodes.cpus // nodes.gpus)} DefMemPerGPU={nodes.real_memory_mb // nodes.gpus}"


def partition_line(name: str, node_names: str, nodes: NodeSet, *, default: bool, job_time: JobTimeLimits) -> str:
    """A partition whose jobs hold the GPUs they ask for (gres), not whole nodes: two small jobs share
    a node, each seeing only its own GPUs (CUDA_VISIBLE_DEVICES from gres, and docker's --gpus with the
    job's devices). A job that asks for every GPU of a node, or --exclusive, gets the node to itself
    (launch does). nodes: what each of them offers, shared out by default (_default_shares). The Spot
    partition has a higher PriorityTier than the default
    (1), so that a job submitted to both (`launch --spot-fallback`: --partition=spot,gpu) takes Spot
    nodes when Slurm can start it there. job_time: its DefaultTime and MaxTime."""
    tier = " PriorityTier=2" if name == SPOT_PARTITION else ""
    return (
        f"PartitionName={check_name('partition', name)} Nodes={node_names} Default={'YES' if default else 'NO'}{tier} "
        f"DefaultTime={job_time.default} MaxTime={job_time.maximum} State=UP OverSubscribe=NO{_default_shares(nodes)}"
    )


def render_gres_conf(gpus: int, device_dir: str = "/dev") -> str:
    """gres.conf naming the GPU device files, which works whether or not a Slurm build has NVML
    (Debian's has not). (device_dir: the local cluster's emulated GPUs live elsewhere.)"""
    count = check_int("gpus", gpus, 1, MAX_GPUS_PER_NODE)
    base = f"{check_path('device_dir', device_dir).rstrip('/')}/nvidia"
    files = f"{base}0" if count == 1 else f"{base}[0-{count - 1}]"
    return f"Name=gpu File={files}\n"


def render_cgroup_conf() -> str:
    """cgroup.conf: each job held to its allocation, as Azure's own Slurm stacks do. The plugin is
    detected (cgroup v2 on Ubuntu 22.04); cores through cpuset, memory at the job's allocation (its
    --mem, else its partition's default share: slurm.conf's DefMemPerGPU; all of the node's RealMemory,
    which leaves the system its part, with --mem=0), and devices: only
    the GPUs the job was given (gres.conf's File=) are open to it."""
    return "CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainDevices=yes\n"


def render_health_check(
    *, shared_mount: str, expected_gpus: int, health: NodeHealth, min_free_gb: int, free_disk_path: str
) -> str:
    """The HealthCheckProgram script with this cluster's defaults (each can still be overridden
    from the environment, see the script): the node kind's InfiniBand ports and rate, and Azure's
    configuration whose boot verdict it reports (infra/health_thresholds.py). It writes its last result
    to the node's file in <shared_mount>/.health (contract.HEALTH_REPORT_DIR) unless HEALTH_REPORT_DIR
    names another."""
    return render_script(
        "slurm/slurm-health-check.sh",
        {
            "SHARED_MOUNT": check_path("shared_mount", shared_mount),
            "EXPECTED_GPUS": check_int("expected_gpus", expected_gpus, 0, MAX_GPUS_PER_NODE),
            "INFINIBAND_PORTS": check_int("infiniband_ports", health.infiniband_ports, 0, MAX_INFINIBAND_PORTS),
            "INFINIBAND_RATE_GBPS": check_int("infiniband_rate_gbps", health.infiniband_rate_gbps, 0, 10_000),
            "AZURE_CHECKS_CONF": check_conf_name(health),
            "AZURE_CHECKS_RESULT": AZURE_CHECKS_RESULT,
            "MIN_FREE_GB": check_int("min_free_gb", min_free_gb, 0, 1_000_000),
            "FREE_DISK_PATH": check_path("free_disk_path", free_disk_path),
            "HEALTH_REPORT_NAME": HEALTH_REPORT_DIR,
        },
    )
