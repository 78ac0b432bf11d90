"""Blob storage: a locked-down account, private `data` and `results` containers, a read-only SAS; kept
by `pulumi destroy`, with soft delete and versioning."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import pulumi
from pulumi_azure_native import storage

from infra.config import PRIVATE_RANGES

DATA_CONTAINER = "data"
RESULTS_CONTAINER = "results"
# The Lustre import's logs (lustreImportData): Azure wants them in another container of the data's account.
LUSTRE_LOG_CONTAINER = "lustre-import-logs"
# The data SAS lets the NFS server and nodes list and read the dataset, nothing more.
DATA_SAS_PERMISSIONS = "rl"
SOFT_DELETE_DAYS = 30  # how long a deleted blob or container, or an overwritten version, can be restored


@dataclass
class StorageArgs:
    resource_group_name: pulumi.Input[str]  # the data's own group (build_stack makes it, kept by destroy too)
    location: str
    allowed_subnet_ids: Sequence[pulumi.Input[str]]
    operator_cidr: str
    sas_expiry: datetime
    tags: Mapping[str, str]
    # lustreImportData: Azure Managed Lustre reads `data` as its HSM backend (infra/lustre.py), which needs
    # the account's shared-key access on and a container for the import's logs. Off: the account keeps
    # Azure's default for shared keys, which this stack never uses.
    lustre_import: bool = False


def operator_ip_rules(cidr: str) -> list[str]:
    """Storage firewall entries for the operator's range.

    The storage firewall takes public ranges only, as /1 to /30 or as single addresses; an open
    SSH range is not a reason to open storage, and an RFC 1918 range cannot be listed at all.
    """
    network = ipaddress.IPv4Network(cidr)
    if network.prefixlen == 0 or any(network.subnet_of(private) for private in PRIVATE_RANGES):
        return []
    if network.prefixlen >= 31:
        return [str(address) for address in (network.hosts() if network.prefixlen == 31 else [network.network_address])]
    return [str(network)]


def _containers(args: StorageArgs) -> tuple[str, ...]:
    """`data` and `results`, and the Lustre import's log container where the import needs one."""
    return (DATA_CONTAINER, RESULTS_CONTAINER, *((LUSTRE_LOG_CONTAINER,) if args.lustre_import else ()))


class Storage(pulumi.ComponentResource):
    """The data that outlives the cluster: datasets, results (models, logs, run records). Every resource
    here is kept by `pulumi destroy` (retain_on_delete: Pulumi forgets it, Azure keeps it), in a resource
    group of its own that the stack makes for it; deleting them is a deliberate `az group delete` (docs/deploy.md).
    Blob soft delete, container soft delete and versioning let a deleted or overwritten result come back
    for SOFT_DELETE_DAYS."""

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, retain_on_delete=True)

        self.account = storage.StorageAccount(
            f"{name}sa",  # auto-named with a random suffix: account names are global
            resource_group_name=args.resource_group_name,
            location=args.location,
            kind="StorageV2",
            sku=storage.SkuArgs(name="Standard_LRS"),
            enable_https_traffic_only=True,
            minimum_tls_version="TLS1_2",
            allow_blob_public_access=False,
            allow_cross_tenant_replication=False,
            # Only where Azure Managed Lustre's import needs it: its resource provider signs with the key.
            allow_shared_key_access=True if args.lustre_import else None,
            network_rule_set=storage.NetworkRuleSetArgs(
                default_action="Deny",
                bypass="AzureServices",
                virtual_network_rules=[
                    storage.VirtualNetworkRuleArgs(virtual_network_resource_id=subnet_id, action="Allow")
                    for subnet_id in args.allowed_subnet_ids
                ],
                ip_rules=[
                    storage.IPRuleArgs(i_p_address_or_range=rule, action="Allow")
                    for rule in operator_ip_rules(args.operator_cidr)
                ],
            ),
            tags=args.tags,
            opts=child,
        )
        self.containers = {
            container: storage.BlobContainer(
                f"{name}-{container}",
                container_name=container,
                account_name=self.account.name,
                resource_group_name=args.resource_group_name,
                public_access="None",
                opts=child,
            )
            for container in _containers(args)
        }
        retention = storage.DeleteRetentionPolicyArgs(enabled=True, days=SOFT_DELETE_DAYS)
        self.blob_service = storage.BlobServiceProperties(
            f"{name}-blob-service",
            account_name=self.account.name,
            resource_group_name=args.resource_group_name,
            blob_services_name="default",
            is_versioning_enabled=True,
            delete_retention_policy=retention,
            container_delete_retention_policy=retention,
            opts=child,
        )
        self.blob_endpoint = self.account.primary_endpoints.apply(lambda endpoints: endpoints.blob)

        sas = storage.list_storage_account_service_sas_output(
            resource_group_name=args.resource_group_name,
            account_name=self.account.name,
            canonicalized_resource=self.account.name.apply(lambda account: f"/blob/{account}/{DATA_CONTAINER}"),
            resource="c",
            permissions=DATA_SAS_PERMISSIONS,
            protocols="https",
            shared_access_expiry_time=args.sas_expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),  # validated as UTC,
        )
        self.data_sas = pulumi.Output.secret(sas.service_sas_token)

        self.register_outputs(
            {
                "account_name": self.account.name,
                "blob_endpoint": self.blob_endpoint,
                "data_sas": self.data_sas,
            }
        )
