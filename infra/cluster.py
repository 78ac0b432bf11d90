"""The GPU cluster: a Uniform scale set of InfiniBand VMs in one placement group, each running slurmd."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import compute

from infra.cloud_init import render_cluster_node
from infra.cloud_init.shared_storage import SharedFileSystem
from infra.config import ImageReference
from infra.contract import GPU_NODE_OS_DISK_GB, SHARED_MOUNT_PATH
from infra.health_thresholds import node_health
from infra.skus import GpuSku
from infra.vm import encode_custom_data, image_reference, linux_configuration, security_profile

BASE36_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
INSTANCE_ID_DIGITS = 6


def _priority(spot: SpotPolicy | None) -> dict[str, object]:
    """The VM profile's priority settings: none for on-demand VMs."""
    if spot is None:
        return {}
    return {
        "priority": "Spot",
        "eviction_policy": spot.eviction_policy,
        "billing_profile": compute.BillingProfileArgs(max_price=spot.max_price_usd),
    }


def scale_set_node_names(computer_name_prefix: str, count: int) -> list[str]:
    """Slurm's names for instances 0..count-1 of a Uniform scale set.

    Azure names instance i computerNamePrefix + i in base 36, six digits (instance 10 is
    ...00000a; Azure may write the letters in upper case, Slurm's names are lower case). With
    overprovisioning off, a new scale set's instance ids are 0..count-1, and scaling in removes the
    highest ids first.
    """
    names = []
    for instance_id in range(count):
        digits = ""
        for _ in range(INSTANCE_ID_DIGITS):
            instance_id, digit = divmod(instance_id, 36)
            digits = BASE36_DIGITS[digit] + digits
        names.append(f"{computer_name_prefix}{digits}")
    return names


@dataclass(frozen=True)
class ScaleSetNames:
    """A scale set's names, fixed before it exists: the head node, created first, is configured with them."""

    base: str  # the GpuCluster's name, e.g. hvd-gpu
    node_count: int

    @property
    def scale_set(self) -> str:
        return f"{self.base}-vmss"

    @property
    def computer_name_prefix(self) -> str:
        return f"{self.base}-"

    @property
    def nodes(self) -> list[str]:
        return scale_set_node_names(self.computer_name_prefix, self.node_count)


@dataclass(frozen=True)
class SpotPolicy:
    """Spot VMs: Azure evicts them (at least 30 s' notice, through Scheduled Events) when it needs the
    capacity back or the price rises above max_price_usd (-1: never for price, up to on-demand)."""

    eviction_policy: str  # Deallocate: keeps the disks and the instance id, so Slurm can start it again
    max_price_usd: float


@dataclass
class GpuClusterArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    subnet_id: pulumi.Input[str]
    sku_name: str
    sku: GpuSku
    names: ScaleSetNames
    image: ImageReference
    admin_user: str
    ssh_public_key: str
    encryption_at_host: bool
    identity_id: pulumi.Input[str]
    identity_client_id: pulumi.Input[str]
    acr_login_server: pulumi.Input[str]
    shared: pulumi.Input[SharedFileSystem]  # what the nodes mount at /shared: the NFS export, or Lustre
    slurmctld_address: str  # the head node's private IP, from which slurmd fetches its configuration
    key_vault_uri: pulumi.Input[str]  # where the nodes fetch the munge key with the identity
    slurm_version: str  # slurmd's, the head node's slurmctld's (slurmVersion)
    tags: Mapping[str, str]
    # Created before the scale set: its reaper deallocates instances that never register with Slurm, so
    # no VM of the set may run, even after a failed `pulumi up`, without it.
    head: pulumi.Resource
    spot: SpotPolicy | None = None  # None: regular (on-demand) VMs


class GpuCluster(pulumi.ComponentResource):
    """One scale set of GPU nodes, on demand or Spot: the stack makes one of each kind, from this one
    definition, so that both have the same hardening (no public IP, SSH keys only, encryption at host,
    one placement group)."""

    def __init__(self, name: str, args: GpuClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:GpuCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.nccl_env = dict(args.sku.nccl_env)
        self.placement_group = self._placement_group(name, args, child)
        self.custom_data = self._custom_data(args)
        self.scale_set = self._scale_set(name, args, child)
        self.register_outputs({"scale_set_name": self.scale_set.name, "placement_group_id": self.placement_group.id})

    @staticmethod
    def _placement_group(
        name: str, args: GpuClusterArgs, child: pulumi.ResourceOptions
    ) -> compute.ProximityPlacementGroup:
        """Keeps the nodes physically close: lowest latency on the InfiniBand fabric."""
        return compute.ProximityPlacementGroup(
            f"{name}-ppg",
            resource_group_name=args.resource_group_name,
            location=args.location,
            proximity_placement_group_type="Standard",
            tags=args.tags,
            opts=child,
        )

    def _custom_data(self, args: GpuClusterArgs) -> pulumi.Output[str]:
        """The nodes' cloud-config, encoded. No secret in it: the munge key is fetched from Key Vault at boot
        (infra/key_vault.py)."""
        inputs = (args.acr_login_server, args.identity_client_id, args.key_vault_uri, args.shared)
        return pulumi.Output.all(*inputs).apply(
            lambda values: encode_custom_data(
                render_cluster_node(
                    shared=values[3],
                    mount_path=SHARED_MOUNT_PATH,
                    acr_login_server=values[0],
                    identity_client_id=values[1],
                    nccl_env=self.nccl_env,
                    expected_gpus=args.sku.gpus_per_node,
                    health=node_health(args.sku_name),
                    slurmctld_address=args.slurmctld_address,
                    key_vault_uri=values[2],
                    nvme_disks=args.sku.nvme_disks,
                    nvme_mount=args.sku.nvme_mount,
                    admin_user=args.admin_user,
                    slurm_version=args.slurm_version,
                )
            )
        )

    def _scale_set(
        self, name: str, args: GpuClusterArgs, child: pulumi.ResourceOptions
    ) -> compute.VirtualMachineScaleSet:
        """The Uniform scale set of the nodes, in the placement group, with the identity that they act as."""
        return compute.VirtualMachineScaleSet(
            f"{name}-vmss",
            vm_scale_set_name=args.names.scale_set,
            resource_group_name=args.resource_group_name,
            location=args.location,
            orchestration_mode="Uniform",
            sku=compute.SkuArgs(name=args.sku_name, tier="Standard", capacity=args.names.node_count),
            # One placement group is one InfiniBand fabric; it also caps the set at 100 VMs.
            single_placement_group=True,
            # Extra VMs would take instance ids that Slurm's node names do not cover.
            overprovision=False,
            platform_fault_domain_count=1,
            proximity_placement_group=compute.SubResourceArgs(id=self.placement_group.id),
            upgrade_policy=compute.UpgradePolicyArgs(mode="Manual"),
            identity=compute.VirtualMachineScaleSetIdentityArgs(
                type="UserAssigned", user_assigned_identities=[args.identity_id]
            ),
            virtual_machine_profile=self._vm_profile(args),
            tags=args.tags,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[args.head])),
        )

    def _vm_profile(self, args: GpuClusterArgs) -> compute.VirtualMachineScaleSetVMProfileArgs:
        """Every node's VM: SSH keys only, the image and its disk, the cluster subnet, encryption at host, Spot."""
        return compute.VirtualMachineScaleSetVMProfileArgs(
            os_profile=compute.VirtualMachineScaleSetOSProfileArgs(
                computer_name_prefix=args.names.computer_name_prefix,
                admin_username=args.admin_user,
                custom_data=self.custom_data,
                linux_configuration=linux_configuration(args.admin_user, args.ssh_public_key),
            ),
            storage_profile=compute.VirtualMachineScaleSetStorageProfileArgs(
                image_reference=image_reference(args.image),
                os_disk=compute.VirtualMachineScaleSetOSDiskArgs(
                    create_option="FromImage",
                    caching="ReadWrite",
                    disk_size_gb=GPU_NODE_OS_DISK_GB,  # room for framework images
                    managed_disk=compute.VirtualMachineScaleSetManagedDiskParametersArgs(
                        storage_account_type="Premium_LRS"
                    ),
                ),
            ),
            network_profile=_network_profile(args.subnet_id),
            security_profile=security_profile(args.encryption_at_host),
            **_priority(args.spot),
        )


def _network_profile(subnet_id: pulumi.Input[str]) -> compute.VirtualMachineScaleSetNetworkProfileArgs:
    """One accelerated NIC on the cluster subnet, without a public IP."""
    return compute.VirtualMachineScaleSetNetworkProfileArgs(
        network_interface_configurations=[
            compute.VirtualMachineScaleSetNetworkConfigurationArgs(
                name="eth0",
                primary=True,
                enable_accelerated_networking=True,
                ip_configurations=[
                    compute.VirtualMachineScaleSetIPConfigurationArgs(
                        name="ipconfig1",
                        primary=True,
                        subnet=compute.ApiEntityReferenceArgs(id=subnet_id),
                    )
                ],
            )
        ]
    )
