"""Wires the components together and returns the outputs that the operator's CLI reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi_azure_native import resources

from infra.accounting import SlurmAccounting, SlurmAccountingArgs
from infra.cloud_init.shared_storage import LustreShare, NfsShare, SharedFileSystem
from infra.cloud_init.slurm import JobTimeLimits
from infra.cluster import GpuCluster, GpuClusterArgs, ScaleSetNames, SpotPolicy
from infra.config import StackConfig
from infra.contract import DATA_PATH, SHARED_MOUNT_PATH, SLURM_PARTITION, SPOT_PARTITION, StackOutput
from infra.head import HeadNode, HeadNodeArgs, SpotNodes, TrackingServer
from infra.identity import (
    ClusterIdentity,
    ClusterIdentityArgs,
    OperatorAccess,
    OperatorAccessArgs,
    ScaleSetPowerIdentity,
    ScaleSetPowerIdentityArgs,
)
from infra.jumpbox import Jumpbox, JumpboxArgs
from infra.kept_results import KeptResults, KeptResultsArgs, approval_request, results_container_id
from infra.key_vault import SlurmKeyVault, SlurmKeyVaultArgs
from infra.lustre import LustreFileSystem, LustreFileSystemArgs, LustreImportArgs
from infra.munge import MungeKey
from infra.network import Network, NetworkArgs
from infra.nfs import NfsServer, NfsServerArgs
from infra.registry import Registry, RegistryArgs
from infra.storage import DATA_CONTAINER, LUSTRE_LOG_CONTAINER, RESULTS_CONTAINER, Storage, StorageArgs
from infra.tracking import TrackingIdentity, TrackingIdentityArgs


@dataclass(frozen=True)
class _Base:
    """What every part of the deployment is declared with."""

    cfg: StackConfig
    net: Network
    common: dict[str, Any]  # resource group, location and tags
    machine: dict[str, Any]  # admin user, SSH key, encryption at host: every VM's
    stack: str  # project/stack: who asks, in requests that others approve


@dataclass(frozen=True)
class _DataSide:
    data_group: resources.ResourceGroup
    store: Storage
    registry: Registry
    identity: ClusterIdentity  # the nodes': pulls images, writes results, reads the munge key
    results_endpoint: pulumi.Input[str]  # the blob endpoint of the account that holds `results`
    tracking: TrackingIdentity  # the head node's MLflow server: writes its artifacts to `results`


@dataclass(frozen=True)
class _SharedSide:
    """The shared file system at /shared: the NFS server (sharedStorage nfs) or Azure Managed Lustre."""

    share: pulumi.Input[SharedFileSystem]  # what the head node and the nodes mount
    nfs: NfsServer | None = None
    lustre: LustreFileSystem | None = None


@dataclass(frozen=True)
class _SlurmSide:
    cluster_name: str
    cluster: GpuCluster
    spot: SpotNodes | None
    head: HeadNode


def build_stack(cfg: StackConfig, project: str, stack: str) -> dict[StackOutput, pulumi.Input]:
    """Declare every resource of the deployment; return the stack outputs by name."""
    tags = cfg.resource_tags(project, stack)
    group = resources.ResourceGroup(f"{cfg.name_prefix}-rg", location=cfg.location, tags=tags)
    common = {"resource_group_name": group.name, "location": cfg.location, "tags": tags}
    net = Network(
        f"{cfg.name_prefix}-net",
        NetworkArgs(vnet_cidr=cfg.vnet_cidr, subnets=cfg.subnets, allowed_ssh_cidr=cfg.allowed_ssh_cidr, **common),
    )
    machine = {
        "admin_user": cfg.admin_user,
        "ssh_public_key": cfg.ssh_public_key,
        "encryption_at_host": cfg.encryption_at_host,
    }
    base = _Base(cfg, net, common, machine, f"{project}/{stack}")
    data = _data_side(base)
    jumpbox = Jumpbox(
        f"{cfg.name_prefix}-jumpbox",
        JumpboxArgs(
            subnet_id=net.subnet_ids["jumpbox"], vm_size=cfg.jumpbox_vm_size, users=cfg.users_list, **machine, **common
        ),
    )
    shared = _nfs_server(base) if cfg.shared_storage == "nfs" else _lustre(base, data)
    slurm = _slurm_side(base, data, shared)
    return _outputs(cfg, group, data, jumpbox, shared, slurm)


def _data_side(base: _Base) -> _DataSide:
    """Storage (in a group of its own), the registry, and the identities that reach them."""
    cfg, prefix, common = base.cfg, base.cfg.name_prefix, base.common
    # The data's own group, kept by `pulumi destroy` like everything in it (infra/storage.py)
    data_group = resources.ResourceGroup(
        f"{prefix}-data-rg",
        location=cfg.location,
        tags=common["tags"],
        opts=pulumi.ResourceOptions(retain_on_delete=True),
    )
    store = Storage(
        prefix,
        StorageArgs(
            allowed_subnet_ids=[base.net.subnet_ids[role] for role in _storage_clients(cfg)],
            operator_cidr=cfg.allowed_ssh_cidr,
            sas_expiry=cfg.sas_expiry,
            lustre_import=cfg.lustre_import_data,
            **{**common, "resource_group_name": data_group.name},
        ),
    )
    registry = Registry(prefix, RegistryArgs(**common))
    containers: dict[str, pulumi.Input[str]] = {name: c.id for name, c in store.containers.items()}
    results_endpoint: pulumi.Input[str] = store.blob_endpoint
    if cfg.kept_results_account:
        # results go to the kept account's container: the nodes and the operator get their roles there
        containers[f"kept-{RESULTS_CONTAINER}"] = results_container_id(cfg.kept_results_account)
        kept = KeptResults(
            f"{prefix}-kept-results",
            KeptResultsArgs(
                account_id=cfg.kept_results_account,
                approval=cfg.kept_results_approval,
                request_message=approval_request(base.stack, cfg.owner),
                vnet_id=base.net.vnet.id,
                subnet_id=base.net.subnet_ids["cluster"],
                **common,
            ),
        )
        results_endpoint = kept.blob_endpoint
    results_id = containers[f"kept-{RESULTS_CONTAINER}" if cfg.kept_results_account else RESULTS_CONTAINER]
    identity = ClusterIdentity(
        f"{prefix}-cluster",
        ClusterIdentityArgs(registry_id=registry.registry.id, results_container_id=results_id, **common),
    )
    tracking = TrackingIdentity(f"{prefix}-mlflow", TrackingIdentityArgs(results_container_id=results_id, **common))
    OperatorAccess(f"{prefix}-operator", OperatorAccessArgs(container_ids=containers))
    return _DataSide(data_group, store, registry, identity, results_endpoint, tracking)


def _storage_clients(cfg: StackConfig) -> list[str]:
    """The subnets the storage account's firewall admits: the nodes', and the one that fills /shared from
    blob (the NFS server's, or the Lustre file system's when it imports `data`; with Lustre alone the head
    node, in the cluster subnet, copies the datasets)."""
    if cfg.shared_storage == "nfs":
        return ["cluster", "nfs"]
    return ["cluster", "lustre"] if cfg.lustre_import_data else ["cluster"]


def _lustre(base: _Base, data: _DataSide) -> _SharedSide:
    """Azure Managed Lustre in its own subnet; with lustreImportData, `data` as its HSM backend."""
    cfg = base.cfg
    assert cfg.lustre_capacity_tib is not None  # infra/config.py requires it with sharedStorage lustre
    containers = data.store.containers
    source = (
        LustreImportArgs(
            account_id=data.store.account.id,
            container_id=containers[DATA_CONTAINER].id,
            logging_container_id=containers[LUSTRE_LOG_CONTAINER].id,
            principal_id=cfg.lustre_hsm_principal_id,
        )
        if cfg.lustre_import_data and cfg.lustre_hsm_principal_id
        else None
    )
    lustre = LustreFileSystem(
        f"{cfg.name_prefix}-lustre",
        LustreFileSystemArgs(
            subnet_id=base.net.subnet_ids["lustre"],
            sku=cfg.lustre_sku,
            capacity_tib=cfg.lustre_capacity_tib,
            zone=None if cfg.lustre_zone == "none" else cfg.lustre_zone,
            maintenance_day=cfg.lustre_maintenance_day,
            maintenance_time_utc=cfg.lustre_maintenance_time,
            import_from=source,
            **base.common,
        ),
    )
    share = lustre.mgs_address.apply(lambda address: LustreShare(address, data_at_root=source is not None))
    return _SharedSide(share, lustre=lustre)


def _nfs_server(base: _Base) -> _SharedSide:
    cfg = base.cfg
    nfs = NfsServer(
        f"{cfg.name_prefix}-nfs",
        NfsServerArgs(
            subnet_id=base.net.subnet_ids["nfs"],
            private_ip=cfg.nfs_private_ip,
            cluster_cidr=cfg.subnets["cluster"],
            vm_size=cfg.nfs_vm_size,
            disk_count=cfg.nfs_disk_count,
            disk_size_gb=cfg.nfs_disk_size_gb,
            **base.machine,
            **base.common,
        ),
    )
    return _SharedSide(NfsShare(nfs.private_ip, nfs.export_path), nfs=nfs)


def _slurm_side(base: _Base, data: _DataSide, shared: _SharedSide) -> _SlurmSide:
    """The munge key in Key Vault, the head node that runs slurmctld, then the GPU nodes (and Spot ones).

    The head node comes first, and needs nothing from the scale sets (their names and ids are computed):
    its reaper deallocates the instances that never register, so a scale set that fails (Spot capacity,
    quota) after another was created leaves no GPU VM running without it.
    """
    cfg, prefix, common, subnet_id = base.cfg, base.cfg.name_prefix, base.common, base.net.subnet_ids["cluster"]
    munge = MungeKey(f"{prefix}-munge")
    accounting = _accounting(base)
    vault = SlurmKeyVault(
        prefix,
        SlurmKeyVaultArgs(
            cluster_subnet_id=subnet_id,
            munge_key=munge.key_base64,
            database_password=accounting.password,
            purge_protection=cfg.key_vault_purge_protection,
            **common,
        ),
    )
    identity = data.identity.identity
    vault.grant_read("nodes", identity.principal_id)  # the on-demand and the Spot nodes' identity
    on_demand = _ScaleSetPlan.of(f"{prefix}-gpu", cfg.node_count, f"{prefix}-head-power", common)
    head_principal = on_demand.power.identity.principal_id
    vault.grant_read("head", head_principal)
    vault.grant_read("head", head_principal, vault.database_password)  # slurmdbd's, the head node's alone
    spot = (
        _ScaleSetPlan.of(f"{prefix}-spot", cfg.spot_node_count, f"{prefix}-spot-power", common)
        if cfg.spot_node_count
        else None
    )
    spot_nodes = _spot_nodes(spot) if spot else None
    head = _head_node(base, data, shared, vault.vault_uri, on_demand, spot_nodes, accounting)
    nodes = {
        "subnet_id": subnet_id,
        "sku_name": cfg.gpu_sku,
        "sku": cfg.sku,
        "image": cfg.image_reference,
        "identity_id": identity.id,
        "identity_client_id": identity.client_id,
        "acr_login_server": data.registry.registry.login_server,
        "shared": shared.share,
        "slurmctld_address": cfg.head_private_ip,
        "key_vault_uri": vault.vault_uri,
        "slurm_version": cfg.slurm_version,
        "head": head,
        **base.machine,
        **common,
    }
    cluster = on_demand.build(nodes)
    if spot:
        spot.build(nodes, SpotPolicy(eviction_policy=cfg.spot_eviction_policy, max_price_usd=cfg.spot_max_price))
    return _SlurmSide(_slurm_cluster_name(cfg), cluster, spot_nodes, head)


def _head_node(
    base: _Base,
    data: _DataSide,
    shared: _SharedSide,
    key_vault_uri: pulumi.Input[str],
    on_demand: _ScaleSetPlan,
    spot: SpotNodes | None,
    accounting: SlurmAccounting,
) -> HeadNode:
    """slurmctld, configured with the scale sets' names and ids before they exist, and the identities that
    power them."""
    cfg = base.cfg
    return HeadNode(
        f"{cfg.name_prefix}-head",
        HeadNodeArgs(
            subnet_id=base.net.subnet_ids["cluster"],
            vm_size=cfg.head_vm_size,
            private_ip=cfg.head_private_ip,
            cluster_name=_slurm_cluster_name(cfg),
            node_names=on_demand.names.nodes,
            node_prefix=on_demand.names.computer_name_prefix,
            sku=cfg.sku,
            autostop_minutes=cfg.autostop_minutes,
            job_time=JobTimeLimits(default=cfg.default_job_time, maximum=cfg.max_job_time),
            scale_set_id=on_demand.power.scale_set_id,
            identity_id=on_demand.power.identity.id,
            identity_client_id=on_demand.power.identity.client_id,
            spot=spot,
            tracking=TrackingServer(
                data.results_endpoint, RESULTS_CONTAINER, data.tracking.identity.id, data.tracking.identity.client_id
            ),
            key_vault_uri=key_vault_uri,
            shared=shared.share,
            slurm_version=cfg.slurm_version,
            # The nodes' image: the same Slurm repository, signing key and apt pin as theirs.
            image=cfg.image_reference,
            os_disk_size_gb=cfg.head_os_disk_size_gb,
            accounting_database=accounting.database,
            database_disk_size_gb=cfg.head_database_disk_size_gb,
            users=cfg.users_list,
            **base.machine,
            **base.common,
        ),
    )


def _accounting(base: _Base) -> SlurmAccounting:
    """slurmdbd's database: MariaDB on the head node, or the team's MySQL Flexible Server (accountingMysqlServer)."""
    cfg = base.cfg
    password = cfg.accounting_mysql_password
    return SlurmAccounting(
        f"{cfg.name_prefix}-accounting",
        SlurmAccountingArgs(
            vnet_id=base.net.vnet.id,
            subnet_id=base.net.subnet_ids["cluster"],
            mysql_server_id=cfg.accounting_mysql_server,
            mysql_user=cfg.accounting_mysql_user,
            mysql_password=pulumi.Output.secret(password.get_secret_value()) if password else None,
            **base.common,
        ),
    )


def _slurm_cluster_name(cfg: StackConfig) -> str:
    return cfg.name_prefix  # lower-case letters and digits, as Slurm's ClusterName wants


@dataclass(frozen=True)
class _ScaleSetPlan:
    """A scale set to be, by its names, and the head node's identity that will power it."""

    names: ScaleSetNames
    power: ScaleSetPowerIdentity

    @classmethod
    def of(cls, base: str, node_count: int, power_name: str, common: dict[str, Any]) -> _ScaleSetPlan:
        names = ScaleSetNames(base, node_count)
        return cls(
            names,
            ScaleSetPowerIdentity(power_name, ScaleSetPowerIdentityArgs(scale_set_name=names.scale_set, **common)),
        )

    def build(self, nodes: dict[str, Any], spot: SpotPolicy | None = None) -> GpuCluster:
        """The scale set, after the head node (nodes["head"]), then the identity's right to power it."""
        cluster = GpuCluster(self.names.base, GpuClusterArgs(names=self.names, spot=spot, **nodes))
        self.power.grant_power(cluster.scale_set.id)
        return cluster


def _outputs(
    cfg: StackConfig,
    group: resources.ResourceGroup,
    data: _DataSide,
    jumpbox: Jumpbox,
    shared: _SharedSide,
    slurm: _SlurmSide,
) -> dict[StackOutput, pulumi.Input]:
    store = data.store
    nfs, lustre = shared.nfs, shared.lustre
    # Where the datasets are: data/ beneath the mount, but at the root of a Lustre file system that imports them.
    data_path = SHARED_MOUNT_PATH if lustre and cfg.lustre_import_data else DATA_PATH
    return {
        StackOutput.RESOURCE_GROUP: group.name,
        StackOutput.DATA_RESOURCE_GROUP: data.data_group.name,
        StackOutput.LOCATION: cfg.location,
        StackOutput.JUMPBOX_PUBLIC_IP: jumpbox.ip_address,
        StackOutput.ADMIN_USER: cfg.admin_user,
        StackOutput.HEAD_PRIVATE_IP: slurm.head.private_ip,
        StackOutput.HEAD_HOSTNAME: slurm.head.hostname,
        StackOutput.SLURM_CLUSTER_NAME: slurm.cluster_name,
        StackOutput.SLURM_PARTITION: SLURM_PARTITION,
        StackOutput.SPOT_PARTITION: SPOT_PARTITION if slurm.spot else None,
        StackOutput.DEFAULT_JOB_TIME: cfg.default_job_time,
        StackOutput.MAX_JOB_TIME: cfg.max_job_time,
        StackOutput.SHARED_STORAGE: cfg.shared_storage,
        StackOutput.NFS_PRIVATE_IP: nfs.private_ip if nfs else None,
        StackOutput.NFS_EXPORT_PATH: nfs.export_path if nfs else None,
        StackOutput.LUSTRE_MGS_ADDRESS: lustre.mgs_address if lustre else None,
        StackOutput.SHARED_MOUNT_PATH: SHARED_MOUNT_PATH,
        StackOutput.DATA_PATH: data_path,
        StackOutput.LOCAL_DATA_PATH: f"{cfg.sku.nvme_mount}/data",
        StackOutput.STORAGE_ACCOUNT: store.account.name,
        StackOutput.BLOB_ENDPOINT: store.blob_endpoint,
        StackOutput.RESULTS_BLOB_ENDPOINT: data.results_endpoint,
        StackOutput.DATA_CONTAINER: DATA_CONTAINER,
        StackOutput.RESULTS_CONTAINER: RESULTS_CONTAINER,
        StackOutput.DATA_SAS: store.data_sas,
        StackOutput.ACR_LOGIN_SERVER: data.registry.registry.login_server,
        StackOutput.SCALE_SET_NAME: slurm.cluster.scale_set.name,
        StackOutput.NODE_COUNT: cfg.node_count,
        StackOutput.GPUS_PER_NODE: cfg.sku.gpus_per_node,
        StackOutput.GPU_SKU: cfg.gpu_sku,
        StackOutput.CLUSTER_IDENTITY_CLIENT_ID: data.identity.identity.client_id,
        StackOutput.NCCL_ENV: slurm.cluster.nccl_env,
    }


def _spot_nodes(spot: _ScaleSetPlan) -> SpotNodes:
    """The Spot scale set as the head node powers it: by its names and its own identity."""
    return SpotNodes(
        names=spot.names.nodes,
        prefix=spot.names.computer_name_prefix,
        scale_set_id=spot.power.scale_set_id,
        identity_id=spot.power.identity.id,
        identity_client_id=spot.power.identity.client_id,
    )
