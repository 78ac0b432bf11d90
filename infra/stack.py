"""Wires the components together and returns the outputs that the launcher reads."""

from __future__ import annotations

import pulumi
from pulumi_azure_native import resources

from infra.cluster import DATA_PATH, NODE_REGISTRY_PATH, SHARED_MOUNT_PATH, GpuCluster, GpuClusterArgs
from infra.config import StackConfig
from infra.identity import ClusterIdentity, ClusterIdentityArgs, OperatorAccess, OperatorAccessArgs
from infra.jumpbox import Jumpbox, JumpboxArgs
from infra.network import Network, NetworkArgs
from infra.nfs import NfsServer, NfsServerArgs
from infra.registry import Registry, RegistryArgs
from infra.storage import DATA_CONTAINER, RESULTS_CONTAINER, Storage, StorageArgs


def build_stack(cfg: StackConfig, project: str, stack: str) -> dict[str, pulumi.Input]:
    """Declare every resource of the deployment; return the stack outputs by name."""
    tags = cfg.resource_tags(project, stack)
    prefix = cfg.name_prefix
    group = resources.ResourceGroup(f"{prefix}-rg", location=cfg.location, tags=tags)
    common = {"resource_group_name": group.name, "location": cfg.location, "tags": tags}

    net = Network(
        f"{prefix}-net",
        NetworkArgs(vnet_cidr=cfg.vnet_cidr, subnets=cfg.subnets, allowed_ssh_cidr=cfg.allowed_ssh_cidr, **common),
    )
    store = Storage(
        prefix,
        StorageArgs(
            allowed_subnet_ids=[net.subnet_ids["cluster"], net.subnet_ids["nfs"]],
            operator_cidr=cfg.allowed_ssh_cidr,
            sas_expiry=cfg.sas_expiry,
            **common,
        ),
    )
    registry = Registry(prefix, RegistryArgs(**common))
    identity = ClusterIdentity(
        f"{prefix}-cluster",
        ClusterIdentityArgs(
            registry_id=registry.registry.id,
            results_container_id=store.containers[RESULTS_CONTAINER].id,
            **common,
        ),
    )
    OperatorAccess(
        f"{prefix}-operator",
        OperatorAccessArgs(container_ids={name: c.id for name, c in store.containers.items()}),
    )
    machine = {
        "admin_user": cfg.admin_user,
        "ssh_public_key": cfg.ssh_public_key,
        "encryption_at_host": cfg.encryption_at_host,
    }
    jumpbox = Jumpbox(
        f"{prefix}-jumpbox",
        JumpboxArgs(subnet_id=net.subnet_ids["jumpbox"], vm_size=cfg.jumpbox_vm_size, **machine, **common),
    )
    nfs = NfsServer(
        f"{prefix}-nfs",
        NfsServerArgs(
            subnet_id=net.subnet_ids["nfs"],
            private_ip=cfg.nfs_private_ip,
            cluster_cidr=cfg.subnets["cluster"],
            vm_size=cfg.nfs_vm_size,
            disk_count=cfg.nfs_disk_count,
            disk_size_gb=cfg.nfs_disk_size_gb,
            **machine,
            **common,
        ),
    )
    cluster = GpuCluster(
        f"{prefix}-gpu",
        GpuClusterArgs(
            subnet_id=net.subnet_ids["cluster"],
            sku=cfg.gpu_sku,
            gpus_per_node=cfg.sku.gpus_per_node,
            node_count=cfg.node_count,
            image=cfg.image_reference,
            identity_id=identity.identity.id,
            identity_client_id=identity.identity.client_id,
            acr_login_server=registry.registry.login_server,
            nfs_server_ip=nfs.private_ip,
            nfs_export_path=nfs.export_path,
            **machine,
            **common,
        ),
    )
    return {
        "resource_group": group.name,
        "location": cfg.location,
        "jumpbox_public_ip": jumpbox.ip_address,
        "admin_user": cfg.admin_user,
        "nfs_private_ip": nfs.private_ip,
        "nfs_export_path": nfs.export_path,
        "shared_mount_path": SHARED_MOUNT_PATH,
        "data_path": DATA_PATH,
        "node_registry_path": NODE_REGISTRY_PATH,
        "storage_account": store.account.name,
        "blob_endpoint": store.blob_endpoint,
        "data_container": DATA_CONTAINER,
        "results_container": RESULTS_CONTAINER,
        "data_sas": store.data_sas,
        "acr_login_server": registry.registry.login_server,
        "scale_set_name": cluster.scale_set.name,
        "node_count": cfg.node_count,
        "gpus_per_node": cfg.sku.gpus_per_node,
        "gpu_sku": cfg.gpu_sku,
        "cluster_identity_client_id": identity.identity.client_id,
        "nccl_env": cluster.nccl_env,
    }
