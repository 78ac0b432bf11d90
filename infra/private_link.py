"""A private endpoint in the cluster subnet to a service the stack does not own, and the private DNS zone,
linked to the VNet, that makes the service's own name resolve to it there: how the nodes reach a kept
storage account (infra/kept_results.py) and the head node a MySQL Flexible Server (infra/accounting.py).
A name resolving to the endpoint is the name the service's TLS certificate carries: clients keep checking it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import pulumi
from pulumi_azure_native import network, privatedns


class ClusterSubnet(Protocol):
    """Where the endpoint goes: the cluster's group (it goes with the cluster), VNet and subnet."""

    resource_group_name: pulumi.Input[str]
    location: str
    vnet_id: pulumi.Input[str]
    subnet_id: pulumi.Input[str]
    tags: Mapping[str, str]


@dataclass
class PrivateLink:
    endpoint: network.PrivateEndpoint
    zone: privatedns.PrivateZone
    link: privatedns.VirtualNetworkLink
    zone_group: network.PrivateDnsZoneGroup


def private_link(
    name: str,
    args: ClusterSubnet,
    *,
    zone: str,
    zone_config: str,
    connections: Mapping[str, list[network.PrivateLinkServiceConnectionArgs]],
    parent: pulumi.Resource,
) -> PrivateLink:
    """The endpoint, the zone (Azure's privatelink zone of the service: privatelink.blob.core.windows.net,
    ...; zone_config its name in the zone group), its link to the VNet, and the zone group that writes the
    endpoint's address into the zone (and keeps it there if the address changes). connections: the
    endpoint's, {"private_link_service_connections": [...]} (approved at once) or
    {"manual_private_link_service_connections": [...]} (a request the service's owner approves)."""
    child = pulumi.ResourceOptions(parent=parent)
    endpoint = network.PrivateEndpoint(
        f"{name}-pe",
        resource_group_name=args.resource_group_name,
        location=args.location,
        subnet=network.SubnetArgs(id=args.subnet_id),
        **connections,
        tags=args.tags,
        opts=child,
    )
    zone = privatedns.PrivateZone(
        f"{name}-zone",
        private_zone_name=zone,
        resource_group_name=args.resource_group_name,
        location="Global",  # private DNS zones are global resources
        tags=args.tags,
        opts=child,
    )
    link = privatedns.VirtualNetworkLink(
        f"{name}-link",
        private_zone_name=zone.name,
        resource_group_name=args.resource_group_name,
        location="Global",
        virtual_network=privatedns.SubResourceArgs(id=args.vnet_id),
        registration_enabled=False,
        # Other accounts or servers of the service with private endpoints elsewhere have no record in this zone,
        # yet Azure's CNAME sends their names here: without the fallback to public resolution they would stop
        # resolving in the VNet.
        resolution_policy=privatedns.ResolutionPolicy.NX_DOMAIN_REDIRECT,
        tags=args.tags,
        opts=child,
    )
    zone_group = network.PrivateDnsZoneGroup(
        f"{name}-dns",
        private_endpoint_name=endpoint.name,
        resource_group_name=args.resource_group_name,
        private_dns_zone_group_name="default",
        private_dns_zone_configs=[network.PrivateDnsZoneConfigArgs(name=zone_config, private_dns_zone_id=zone.id)],
        opts=child,
    )
    return PrivateLink(endpoint, zone, link, zone_group)
