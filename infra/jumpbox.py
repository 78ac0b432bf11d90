"""Jumpbox: the one machine with a public IP, the SSH entry point to the private subnets."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
from pulumi_azure_native import network

from infra.cloud_init.jumpbox import render_jumpbox
from infra.users import UsersList
from infra.vm import LinuxVm, LinuxVmArgs, MachineArgs, encode_custom_data


@dataclass
class JumpboxArgs(MachineArgs):
    """What every machine takes, and the stack config's people, whose connections it forwards; its public
    IP is its own child."""

    users: UsersList = field(default_factory=UsersList)


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
                **args.machine_fields(),
                public_ip_id=self.public_ip.id,
                accelerated_networking=False,  # small burstable sizes do not support it
                # the people's accounts (a copy of the list, which `dtrain users` refreshes): read at the
                # first boot only, as every machine's custom data
                custom_data=encode_custom_data(render_jumpbox(args.users)),
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.ip_address = self.public_ip.ip_address
        self.register_outputs({"public_ip": self.ip_address})
