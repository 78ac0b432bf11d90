"""Pieces shared by the jumpbox, the NFS server, the head node and the scale set: SSH-key-only Linux VMs."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import pulumi
from pulumi_azure_native import compute, network

from infra.cloud_init import custom_data_bytes
from infra.config import ImageReference

UBUNTU_2204 = ImageReference("Canonical", "0001-com-ubuntu-server-jammy", "22_04-lts-gen2", "latest")


def linux_configuration(admin_user: str, ssh_public_key: str) -> compute.LinuxConfigurationArgs:
    """SSH keys only: password authentication is disabled on every machine."""
    return compute.LinuxConfigurationArgs(
        disable_password_authentication=True,
        ssh=compute.SshConfigurationArgs(
            public_keys=[
                compute.SshPublicKeyArgs(key_data=ssh_public_key, path=f"/home/{admin_user}/.ssh/authorized_keys")
            ]
        ),
    )


def image_reference(image: ImageReference) -> compute.ImageReferenceArgs:
    return compute.ImageReferenceArgs(
        publisher=image.publisher, offer=image.offer, sku=image.sku, version=image.version
    )


def security_profile(encryption_at_host: bool) -> compute.SecurityProfileArgs:
    """Encryption at host also covers the temp disk and the host-side disk caches.

    Azure's default encryption of managed disks leaves those out: the NFS server's ReadOnly-cached
    dataset disks and the nodes' ReadWrite-cached OS disks would otherwise sit in plain text.
    """
    return compute.SecurityProfileArgs(encryption_at_host=encryption_at_host)


def encode_custom_data(cloud_config: str) -> str:
    """The cloud-config as the customData property takes it: base64 of custom_data_bytes (gzipped)."""
    return base64.b64encode(custom_data_bytes(cloud_config)).decode()


@dataclass
class MachineArgs:
    """What every single VM role (jumpbox, NFS server, head node) is given."""

    resource_group_name: pulumi.Input[str]
    location: str
    subnet_id: pulumi.Input[str]
    vm_size: str
    admin_user: str
    ssh_public_key: str
    encryption_at_host: bool
    tags: Mapping[str, str]

    def machine_fields(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies, and Outputs must pass through as they are.
        return {f.name: getattr(self, f.name) for f in fields(MachineArgs)}


@dataclass
class LinuxVmArgs(MachineArgs):
    image: ImageReference = UBUNTU_2204
    private_ip: str | None = None  # static when set, else dynamic
    public_ip_id: pulumi.Input[str] | None = None
    data_disks: Sequence[compute.DataDiskArgs] = field(default_factory=list)
    os_disk_size_gb: int | None = None  # None: the image's own size
    custom_data: pulumi.Input[str] | None = None  # base64 cloud-config
    accelerated_networking: bool = True
    identity_ids: Sequence[pulumi.Input[str]] = ()  # user-assigned managed identities
    # cloud-init reads custom data at the first boot only; Azure would store a new one unread.
    rebuild_on_custom_data_change: bool = False


class LinuxVm(pulumi.ComponentResource):
    """A NIC and an Ubuntu VM with premium disks that are deleted with it."""

    def __init__(self, name: str, args: LinuxVmArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:LinuxVm", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.nic = network.NetworkInterface(
            f"{name}-nic",
            resource_group_name=args.resource_group_name,
            location=args.location,
            enable_accelerated_networking=args.accelerated_networking,
            ip_configurations=[
                network.NetworkInterfaceIPConfigurationArgs(
                    name="ipconfig1",
                    primary=True,
                    subnet=network.SubnetArgs(id=args.subnet_id),
                    private_ip_allocation_method="Static" if args.private_ip else "Dynamic",
                    private_ip_address=args.private_ip,
                    public_ip_address=network.PublicIPAddressArgs(id=args.public_ip_id) if args.public_ip_id else None,
                )
            ],
            tags=args.tags,
            opts=child,
        )
        vm_opts = child
        if args.rebuild_on_custom_data_change:
            # Deleted first: the new VM takes over the NIC, which holds the static address. A new OS
            # disk size too: Azure grows a VM's OS disk only while the VM is deallocated.
            vm_opts = pulumi.ResourceOptions(
                parent=self,
                replace_on_changes=["osProfile.customData", "storageProfile.osDisk.diskSizeGB"],
                delete_before_replace=True,
            )
        self.vm = compute.VirtualMachine(
            f"{name}-vm",
            resource_group_name=args.resource_group_name,
            location=args.location,
            hardware_profile=compute.HardwareProfileArgs(vm_size=args.vm_size),
            os_profile=compute.OSProfileArgs(
                computer_name=name,
                admin_username=args.admin_user,
                custom_data=args.custom_data,
                linux_configuration=linux_configuration(args.admin_user, args.ssh_public_key),
            ),
            storage_profile=compute.StorageProfileArgs(
                image_reference=image_reference(args.image),
                os_disk=compute.OSDiskArgs(
                    create_option="FromImage",
                    delete_option="Delete",
                    disk_size_gb=args.os_disk_size_gb,
                    managed_disk=compute.ManagedDiskParametersArgs(storage_account_type="Premium_LRS"),
                ),
                data_disks=list(args.data_disks),
            ),
            network_profile=compute.NetworkProfileArgs(
                network_interfaces=[compute.NetworkInterfaceReferenceArgs(id=self.nic.id, primary=True)]
            ),
            security_profile=security_profile(args.encryption_at_host),
            identity=compute.VirtualMachineIdentityArgs(
                type="UserAssigned", user_assigned_identities=list(args.identity_ids)
            )
            if args.identity_ids
            else None,
            tags=args.tags,
            opts=vm_opts,
        )
        self.private_ip = self.nic.ip_configurations.apply(lambda configs: configs[0].private_ip_address)
        self.register_outputs({"vm_id": self.vm.id, "private_ip": self.private_ip})
