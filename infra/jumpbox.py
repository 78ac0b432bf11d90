"""Jumpbox: the one machine with a public IP, the SSH entry point to the private subnets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import network

from infra.vm import LinuxVm, LinuxVmArgs


@dataclass
class JumpboxArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    subnet_id: pulumi.Input[str]
    vm_size: str
    admin_user: str
    ssh_public_key: str
    tags: Mapping[str, str]


class Jumpbox(pulumi.ComponentResource):
    def __init__(self, name: str, args: JumpboxArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:Jumpbox", name, None, opts)
        self.public_ip = network.PublicIPAddress(
            f"{name}-pip",
            resource_group_name=args.resource_group_name,
            location=args.location,
            sku=network.PublicIPAddressSkuArgs(name="Standard"),  # Standard IPs are closed until an NSG allows
            public_ip_allocation_method="Static",
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.machine = LinuxVm(
            name,
            LinuxVmArgs(
                resource_group_name=args.resource_group_name,
                location=args.location,
                subnet_id=args.subnet_id,
                vm_size=args.vm_size,
                admin_user=args.admin_user,
                ssh_public_key=args.ssh_public_key,
                public_ip_id=self.public_ip.id,
                accelerated_networking=False,  # small burstable sizes do not support it
                tags=args.tags,
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.ip_address = self.public_ip.ip_address
        self.register_outputs({"public_ip": self.ip_address})
