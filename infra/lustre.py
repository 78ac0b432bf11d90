"""Azure Managed Lustre (sharedStorage lustre): the cluster's shared file system as a managed parallel file
system in a subnet of its own, instead of the NFS server VM (infra/nfs.py).

Its throughput grows with its capacity (the tier's MB/s per TiB, infra/data/amlfs_skus.json), where one
NFS server is capped by its VM's network and disks: docs/infrastructure.md, "Shared storage: NFS server
or Azure Managed Lustre", says when each pays. The head node and the nodes mount it at /shared with the
Lustre client of their image (ubuntu-hpc carries amlfs-lustre-client; dtrain/remote/boot/lustre-mount.sh),
and unmount it before the VM goes (dtrain/remote/boot/shared_release.py).

With `import_from`, the file system is created with the `data` container as its Lustre HSM backend
(Azure's "blob integration"): the container's datasets appear under /shared at creation, their content
read from blob on first access. Azure sets that up only at creation, and needs three things of the
storage account before it (amlfs-prerequisites): shared-key access enabled (Azure's resource provider
signs its blob access with the account key), a second container for the import's logs, and two roles
for Azure's "HPC Cache Resource Provider" service principal on the account, Storage Account
Contributor (which reads the keys) and Storage Blob Data Contributor. Deletes in Lustre never reach
blob: the container stays the dataset's record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import authorization, storagecache

from infra.azure_limits import AmlfsSku
from infra.identity import STORAGE_BLOB_DATA_CONTRIBUTOR, grant, role_definition_id

# The file system name that Azure Managed Lustre gives every file system: clients mount <MGS>@tcp:/lustrefs.
LUSTRE_FS_NAME = "lustrefs"
# Built-in role (the same id in every tenant): manage the account, list its keys.
STORAGE_ACCOUNT_CONTRIBUTOR = "17d1049b-9a84-46fb-8f53-869881c3d3ab"
# The import's roles on the storage account: Azure's documented pair, granted before the file system.
IMPORT_ROLES = {
    "account-contributor": STORAGE_ACCOUNT_CONTRIBUTOR,
    "blob-data-contributor": STORAGE_BLOB_DATA_CONTRIBUTOR,
}


@dataclass
class LustreImportArgs:
    """The `data` container as the file system's HSM backend (its datasets appear under /shared)."""

    account_id: pulumi.Input[str]  # the storage account that holds both containers
    container_id: pulumi.Input[str]  # the `data` container
    logging_container_id: pulumi.Input[str]  # the import's logs: another container of the same account
    principal_id: str  # the HPC Cache Resource Provider's object id in this tenant (lustreHsmPrincipalId)


@dataclass
class LustreFileSystemArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    subnet_id: pulumi.Input[str]  # its own subnet (infra/network.py: only the Lustre ports, from the cluster)
    sku: AmlfsSku
    capacity_tib: int
    zone: str | None  # an availability zone, or None in a region without zones
    maintenance_day: str
    maintenance_time_utc: str  # HH:MM
    tags: Mapping[str, str]
    import_from: LustreImportArgs | None = None


class LustreFileSystem(pulumi.ComponentResource):
    def __init__(self, name: str, args: LustreFileSystemArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:LustreFileSystem", name, None, opts)
        grants = self._import_roles(name, args.import_from)
        self.file_system = storagecache.AmlFilesystem(
            f"{name}-fs",
            resource_group_name=args.resource_group_name,
            location=args.location,
            sku=storagecache.SkuNameArgs(name=args.sku.name),
            storage_capacity_ti_b=args.capacity_tib,
            filesystem_subnet=args.subnet_id,
            zones=[args.zone] if args.zone else None,
            maintenance_window=storagecache.AmlFilesystemMaintenanceWindowArgs(
                day_of_week=args.maintenance_day, time_of_day_utc=args.maintenance_time_utc
            ),
            hsm=self._hsm(args.import_from),
            # As the NFS export's no_root_squash (infra/cloud_init/nfs_server.py): root on the head node (runs/),
            # on the nodes (the health and boot reports) and in the training containers writes there; only the
            # cluster subnet reaches the file system.
            root_squash_settings=storagecache.AmlFilesystemRootSquashSettingsArgs(mode="None"),
            tags=args.tags,
            # Azure checks the container access only once creation runs, and fails it without the roles.
            opts=pulumi.ResourceOptions(parent=self, depends_on=grants),
        )
        self.mgs_address: pulumi.Output[str] = self.file_system.client_info.apply(lambda info: info.mgs_address)
        self.register_outputs({"mgs_address": self.mgs_address})

    def _import_roles(self, name: str, source: LustreImportArgs | None) -> list[pulumi.Resource]:
        if source is None:
            return []
        subscription_id = authorization.get_client_config_output().subscription_id
        return [
            grant(
                f"{name}-import-{what}",
                source.principal_id,
                role_definition_id(subscription_id, role),
                source.account_id,
                self,
                "ServicePrincipal",
            )
            for what, role in IMPORT_ROLES.items()
        ]

    @staticmethod
    def _hsm(source: LustreImportArgs | None) -> storagecache.AmlFilesystemHsmArgs | None:
        if source is None:
            return None
        return storagecache.AmlFilesystemHsmArgs(
            settings=storagecache.AmlFilesystemHsmSettingsArgs(
                container=source.container_id,
                logging_container=source.logging_container_id,
                import_prefixes_initial=["/"],  # the whole container: every dataset staged there
            )
        )
