"""The head node: slurmctld and slurmdbd, the login node, and the only holder of the right to power the nodes.

A small VM of its own in the cluster subnet, with a static private address the nodes fetch their
configuration from, no public IP (SSH through the jumpbox), and its own user-assigned identity, the
one that holds the scale set's power role (infra/identity.py). Keeping that identity off the NFS
server and the GPU nodes means the machine that can start and stop the nodes runs nothing a
training job or a dataset pull can reach.

With the accounting database on the head node (MariaDB, infra/accounting.py), its data lives on a managed
disk of its own, attached at LUN 0 and detached, not deleted, with the VM: a new head node (a changed
slurm.conf rebuilds it) finds every job's record where the old one left it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import compute

from infra.cloud_init import render_cgroup_conf, render_gres_conf, render_head_node, render_slurm_conf
from infra.cloud_init.accounting import AccountingDatabase, HeadAccounting
from infra.cloud_init.cluster_node import EPILOG_PATH, HEALTH_CHECK_PATH, PROLOG_PATH
from infra.cloud_init.head_node import (
    RESUME_FAIL_PROGRAM,
    RESUME_PROGRAM,
    STATE_SAVE_DIR,
    SUSPEND_PROGRAM,
)
from infra.cloud_init.shared_storage import SharedFileSystem
from infra.cloud_init.slurm import HealthCheck, JobTimeLimits, NodeSet, PowerSaving
from infra.config import ImageReference
from infra.contract import SHARED_MOUNT_PATH, SLURM_PARTITION
from infra.skus import GpuSku
from infra.users import UsersList
from infra.vm import LinuxVm, LinuxVmArgs, MachineArgs, encode_custom_data

# A deallocated ND-series VM must be placed on a host again (a large size, in one placement group),
# boot with 1-2 TB of memory, bring up 8 GPUs, their fabric manager and the InfiniBand links, and
# mount NFS before slurmd registers: 10-20 minutes is common, more when capacity is tight. Then
# Azure's node health checks run before slurmd (minutes; bounded at 15: azure_checks.py). Shorter,
# and a node still booting is marked DOWN and its job requeued; much longer, and a node that
# will never come keeps its job waiting.
RESUME_TIMEOUT_S = 45 * 60
# How long a node that Slurm did not start (a new scale set's instances: their first boot) may run
# without registering before the head node deallocates it (slurm-power reap). Longer than
# ResumeTimeout: a first boot also installs packages and waits for the identity's new role
# assignments, which Azure may take up to 30 minutes to propagate (the boot steps retry that long).
REGISTER_TIMEOUT_S = 60 * 60
# How long slurmctld may leave the reaper unanswered before it deallocates every node (Slurm failed on
# the head node: nothing vouches for them). As long, for the same first boot: the head node's own
# munge key waits for its role assignment before slurmctld can start.
CONTROLLER_GRACE_S = REGISTER_TIMEOUT_S
# Deallocating a large VM takes minutes; Slurm waits this long before it may start the node again.
SUSPEND_TIMEOUT_S = 10 * 60
HEALTH_CHECK_INTERVAL_S = 5 * 60
SLURMD_SPOOL_DIR = "/var/spool/slurmd"


@dataclass
class SpotNodes:
    """The Spot scale set's nodes, as the head node powers them: with an identity of their own."""

    names: Sequence[str]
    prefix: str
    scale_set_id: pulumi.Input[str]
    identity_id: pulumi.Input[str]
    identity_client_id: pulumi.Input[str]


@dataclass
class TrackingServer:
    """The head node's MLflow server: its artifacts go to the results container, written with an identity
    of its own (infra/tracking.py: Storage Blob Data Contributor on that container alone)."""

    results_endpoint: pulumi.Input[str]
    container: str
    identity_id: pulumi.Input[str]
    identity_client_id: pulumi.Input[str]


@dataclass
class HeadNodeArgs(MachineArgs):
    private_ip: str
    cluster_name: str
    node_names: Sequence[str]
    node_prefix: str
    sku: GpuSku
    autostop_minutes: int  # 0: never
    job_time: JobTimeLimits  # every partition's DefaultTime and MaxTime
    scale_set_id: pulumi.Input[str]
    identity_id: pulumi.Input[str]  # the holder of the scale set's power role, on this VM alone
    identity_client_id: pulumi.Input[str]
    key_vault_uri: pulumi.Input[str]  # where the node fetches the munge key with its identity
    shared: pulumi.Input[SharedFileSystem]  # what it mounts at /shared: the NFS export, or Lustre
    slurm_version: str  # slurmctld's, the nodes' slurmd's (slurmVersion)
    image: ImageReference  # the nodes' (ubuntu-hpc): Microsoft's Slurm repository, its key and the apt pin
    os_disk_size_gb: int  # headOsDiskSizeGb
    accounting_database: AccountingDatabase  # where slurmdbd keeps its records (infra/accounting.py)
    database_disk_size_gb: int  # headDatabaseDiskSizeGb: the data disk of MariaDB on this node
    spot: SpotNodes | None = None  # the `spot` partition's scale set, if the stack has one
    tracking: TrackingServer | None = None  # MLflow on this node (infra/cloud_init/mlflow.py)
    users: UsersList | None = None  # the stack config's people: seed the list the head keeps (infra/users.py)


def slurm_conf(name: str, args: HeadNodeArgs) -> str:
    def node_set(names: Sequence[str]) -> NodeSet:
        return NodeSet(
            names=names, cpus=args.sku.vcpus, real_memory_mb=args.sku.slurm_real_memory_mb, gpus=args.sku.gpus_per_node
        )

    return render_slurm_conf(
        cluster_name=args.cluster_name,
        controller_host=name,
        controller_address=args.private_ip,
        partition=SLURM_PARTITION,
        nodes=node_set(args.node_names),
        spot_nodes=node_set(args.spot.names) if args.spot else None,
        state_save_dir=STATE_SAVE_DIR,
        slurmd_spool_dir=SLURMD_SPOOL_DIR,
        power=PowerSaving(
            suspend_program=SUSPEND_PROGRAM,
            resume_program=RESUME_PROGRAM,
            resume_fail_program=RESUME_FAIL_PROGRAM,
            suspend_time_s=args.autostop_minutes * 60 or None,
            suspend_timeout_s=SUSPEND_TIMEOUT_S,
            resume_timeout_s=RESUME_TIMEOUT_S,
        ),
        health_check=HealthCheck(program=HEALTH_CHECK_PATH, interval_s=HEALTH_CHECK_INTERVAL_S),
        # Labels the job's GPUs for the DCGM exporter (hpc_job); the epilog takes the label off again and
        # removes the job's containers, which dockerd keeps out of Slurm's reach.
        prolog=PROLOG_PATH,
        epilog=EPILOG_PATH,
        job_time=args.job_time,
    )


class HeadNode(pulumi.ComponentResource):
    def __init__(self, name: str, args: HeadNodeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:HeadNode", name, None, opts)
        conf = slurm_conf(name, args)
        # No secret in it: the munge key is fetched from Key Vault at boot (infra/key_vault.py).
        spot = args.spot
        spot_inputs = [spot.scale_set_id, spot.identity_client_id] if spot else []
        tracking = args.tracking
        tracking_inputs = [tracking.results_endpoint, tracking.identity_client_id] if tracking else []
        # slurmdbd beside slurmctld, on the controller's name and address; the admin user submits the jobs
        accounting = HeadAccounting(
            cluster_name=args.cluster_name,
            dbd_host=name,
            dbd_address=args.private_ip,
            database=args.accounting_database,
            users=[args.admin_user],
        )
        self.custom_data = pulumi.Output.all(
            args.shared, args.scale_set_id, args.identity_client_id, args.key_vault_uri, *spot_inputs, *tracking_inputs
        ).apply(
            lambda values: encode_custom_data(
                render_head_node(
                    slurm_conf=conf,
                    gres_conf=render_gres_conf(args.sku.gpus_per_node),
                    cgroup_conf=render_cgroup_conf(),
                    slurm_version=args.slurm_version,
                    key_vault_uri=values[3],
                    shared=values[0],
                    mount_path=SHARED_MOUNT_PATH,
                    scale_set_id=values[1],
                    identity_client_id=values[2],
                    node_prefix=args.node_prefix,
                    admin_user=args.admin_user,
                    register_timeout_s=REGISTER_TIMEOUT_S,
                    controller_grace_s=CONTROLLER_GRACE_S,
                    # autostopMinutes 0 keeps idle nodes up: those that came up on their own too
                    power_down_unused=args.autostop_minutes > 0,
                    spot_scale_set=(
                        {"scale_set_id": values[4], "identity_client_id": values[5], "node_prefix": spot.prefix}
                        if spot
                        else None
                    ),
                    telemetry_nodes=[*args.node_names, *(spot.names if spot else [])],
                    tracking=_tracking_values(args, values[-2:]) if tracking else None,
                    accounting=accounting,
                    users=args.users,
                )
            )
        )
        data_disks = [self._database_disk(name, args)] if accounting.local else []
        self.machine = LinuxVm(
            name,
            LinuxVmArgs(
                **args.machine_fields(),
                image=args.image,
                os_disk_size_gb=args.os_disk_size_gb,
                data_disks=data_disks,
                private_ip=args.private_ip,
                custom_data=self.custom_data,
                identity_ids=[
                    args.identity_id,
                    *([spot.identity_id] if spot else []),
                    *([tracking.identity_id] if tracking else []),
                ],
                # Slurm's control traffic is small, and not every size a user may pick supports it.
                accelerated_networking=False,
                # cloud-init applies custom data at the first boot only: a new slurm.conf (another
                # node count, size or autostop) needs a new head node.
                rebuild_on_custom_data_change=True,
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.private_ip = args.private_ip
        self.hostname = name  # LinuxVm names the computer after the component
        self.register_outputs({"private_ip": self.private_ip, "hostname": self.hostname})

    def _database_disk(self, name: str, args: HeadNodeArgs) -> compute.DataDiskArgs:
        """MariaDB's disk: a managed disk of its own (it outlives a rebuilt VM), the node's LUN 0, with no
        way in but through the VM. ReadOnly caching: reads come from the host's cache, and every write
        reaches the disk before MariaDB is told it has (its commits must survive a host failure)."""
        self.database_disk = compute.Disk(
            f"{name}-db-disk",
            resource_group_name=args.resource_group_name,
            location=args.location,
            creation_data=compute.CreationDataArgs(create_option="Empty"),
            disk_size_gb=args.database_disk_size_gb,
            sku=compute.DiskSkuArgs(name="Premium_LRS"),
            network_access_policy="DenyAll",
            public_network_access="Disabled",
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )
        return compute.DataDiskArgs(
            lun=0,
            create_option="Attach",
            managed_disk=compute.ManagedDiskParametersArgs(id=self.database_disk.id),
            caching="ReadOnly",
            delete_option="Detach",
        )


def _tracking_values(args: HeadNodeArgs, resolved: list[str]) -> dict[str, str]:
    """render_head_node's tracking: the resolved endpoint and client id, and where the server listens."""
    assert args.tracking is not None
    endpoint, client_id = resolved
    return {
        "listen_ip": args.private_ip,
        "results_endpoint": endpoint,
        "container": args.tracking.container,
        "identity_client_id": client_id,
    }
