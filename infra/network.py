"""Network: one VNet, a subnet per role, and NSGs that deny inbound unless a rule says otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import network

from infra.contract import (
    CONTAINER_SSH_PORT,
    LUSTRE_CLIENT_PORTS,
    LUSTRE_PORT,
    SLURMCTLD_PORT,
    SLURMD_PORT,
    SRUN_PORTS,
    SSH_PORT,
)

# Azure's default rules allow all traffic from inside the VNet at priority 65000; a deny at
# the lowest user priority overrides them, so only the rules above it admit anything.
DENY_ALL_PRIORITY = 4096
# Azure services a subnet reaches over the backbone, whose firewalls admit that subnet: nodes and the
# NFS server read blob storage; the head node and the nodes fetch the munge key from Key Vault; the
# Lustre file system reads and writes its HSM container (lustreImportData).
SERVICE_ENDPOINTS = {
    "cluster": ("Microsoft.Storage", "Microsoft.KeyVault"),
    "nfs": ("Microsoft.Storage",),
    "lustre": ("Microsoft.Storage",),
}


@dataclass
class NetworkArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    vnet_cidr: str
    subnets: Mapping[str, str]  # role ("cluster", "nfs" or "lustre", "jumpbox") -> CIDR
    allowed_ssh_cidr: str
    tags: Mapping[str, str]


def _allow(name: str, priority: int, source: str, ports: list[str], protocol: str = "Tcp", source_ports: str = "*"):
    return network.SecurityRuleArgs(
        name=name,
        priority=priority,
        direction="Inbound",
        access="Allow",
        protocol=protocol,
        source_address_prefix=source,
        source_port_range=source_ports,
        destination_address_prefix="*",
        destination_port_ranges=ports,
    )


def _deny_all_inbound():
    return network.SecurityRuleArgs(
        name="DenyAllInbound",
        priority=DENY_ALL_PRIORITY,
        direction="Inbound",
        access="Deny",
        protocol="*",
        source_address_prefix="*",
        source_port_range="*",
        destination_address_prefix="*",
        destination_port_range="*",
    )


def security_rules(args: NetworkArgs) -> dict[str, list[network.SecurityRuleArgs]]:
    """Inbound rules per subnet role. Outbound keeps Azure's defaults (apt, registry, storage)."""
    cluster, jumpbox = args.subnets["cluster"], args.subnets["jumpbox"]
    ssh = str(SSH_PORT)
    storage = {"lustre": _lustre_rules(args.subnets["lustre"], cluster)} if "lustre" in args.subnets else {}
    rules = {
        "cluster": [
            # slurmctld (head node), slurmd (nodes) and srun (head node, nodes) talk only inside the
            # cluster subnet. AllowClusterInternal admits them as well; named on their own, they
            # stay open if that rule is ever narrowed.
            _allow("AllowSlurmInCluster", 100, cluster, [str(SLURMCTLD_PORT), str(SLURMD_PORT), SRUN_PORTS]),
            # Horovod/NCCL bootstrap and gloo use ephemeral ports between nodes.
            _allow("AllowClusterInternal", 110, cluster, ["0-65535"], protocol="*"),
            # The head node (the login node) and the GPU nodes are reached through the jumpbox.
            _allow("AllowSshFromJumpbox", 120, jumpbox, [ssh, str(CONTAINER_SSH_PORT)]),
            _deny_all_inbound(),
        ],
        "nfs": [
            _allow("AllowNfsFromCluster", 100, cluster, ["2049"]),  # NFSv4 needs only 2049
            _allow("AllowSshFromJumpbox", 110, jumpbox, [ssh]),
            _deny_all_inbound(),
        ],
        "jumpbox": [
            _allow("AllowSshFromOperator", 100, args.allowed_ssh_cidr, [ssh]),
            _deny_all_inbound(),
        ],
        **storage,
    }
    return {role: rules[role] for role in args.subnets}


def _lustre_rules(lustre: str, cluster: str) -> list[network.SecurityRuleArgs]:
    """Azure Managed Lustre's subnet: what Azure's own locked-down rule set admits, and no SSH (nothing there
    is ours to log in to). Every client connection goes from the client's privileged ports to LNet's port
    988; the answers, and the file system's own outbound connections (Azure's monitoring, the HSM
    container), need no inbound rule: security rules are stateful."""
    return [
        # the file system's servers (MGS, MDS, OSS) talk to each other across the subnet
        _allow("AllowLustreWithinSubnet", 100, lustre, ["0-65535"], protocol="*"),
        _allow("AllowLustreFromCluster", 110, cluster, [str(LUSTRE_PORT)], source_ports=LUSTRE_CLIENT_PORTS),
        _deny_all_inbound(),
    ]


class Network(pulumi.ComponentResource):
    """VNet with standalone subnets (never inline: mixing the two makes Pulumi fight itself)."""

    subnet_ids: dict[str, pulumi.Output[str]]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        self.vnet = network.VirtualNetwork(
            f"{name}-vnet",
            resource_group_name=args.resource_group_name,
            location=args.location,
            address_space=network.AddressSpaceArgs(address_prefixes=[args.vnet_cidr]),
            tags=args.tags,
            # Subnets are separate resources; keep the VNet from deleting them on update.
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["subnets"]),
        )

        self.subnet_ids = {}
        for role, rules in security_rules(args).items():
            nsg = network.NetworkSecurityGroup(
                f"{name}-{role}-nsg",
                resource_group_name=args.resource_group_name,
                location=args.location,
                security_rules=rules,
                tags=args.tags,
                opts=child,
            )
            subnet = network.Subnet(
                f"{name}-{role}",
                resource_group_name=args.resource_group_name,
                virtual_network_name=self.vnet.name,
                address_prefix=args.subnets[role],
                network_security_group=network.NetworkSecurityGroupArgs(id=nsg.id),
                service_endpoints=[
                    network.ServiceEndpointPropertiesFormatArgs(service=service)
                    for service in SERVICE_ENDPOINTS.get(role, ())
                ]
                or None,
                # Outbound only (apt, registry pulls); nothing here has an inbound public IP.
                # A NAT gateway is the managed alternative where policy requires explicit egress.
                default_outbound_access=True,
                opts=child,
            )
            self.subnet_ids[role] = subnet.id

        self.register_outputs({"vnet_id": self.vnet.id, **{f"{r}_subnet_id": i for r, i in self.subnet_ids.items()}})
