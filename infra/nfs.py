"""NFS file server: premium data disks striped as RAID 0, exported to the cluster subnet only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pulumi
from pulumi_azure_native import compute

from infra.cloud_init import render_nfs_server
from infra.vm import LinuxVm, LinuxVmArgs, encode_custom_data

EXPORT_PATH = "/export"
# Shipped onto the server as /usr/local/bin/blob-pull: pulls the dataset with the read-only SAS.
BLOB_PULL_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "blob_pull.py"


@dataclass
class NfsServerArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    subnet_id: pulumi.Input[str]
    private_ip: str
    cluster_cidr: str
    vm_size: str
    disk_count: int
    disk_size_gb: int
    admin_user: str
    ssh_public_key: str
    tags: Mapping[str, str]


class NfsServer(pulumi.ComponentResource):
    def __init__(self, name: str, args: NfsServerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:NfsServer", name, None, opts)
        cloud_config = render_nfs_server(
            data_disk_count=args.disk_count,
            export_path=EXPORT_PATH,
            allowed_cidr=args.cluster_cidr,
            blob_pull_script=BLOB_PULL_SCRIPT.read_text(),
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
                private_ip=args.private_ip,
                data_disks=[
                    compute.DataDiskArgs(
                        lun=lun,
                        create_option="Empty",
                        disk_size_gb=args.disk_size_gb,
                        caching="ReadOnly",  # training reads the dataset many times over
                        delete_option="Delete",
                        managed_disk=compute.ManagedDiskParametersArgs(storage_account_type="Premium_LRS"),
                    )
                    for lun in range(args.disk_count)
                ],
                custom_data=encode_custom_data(cloud_config),
                tags=args.tags,
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.private_ip = args.private_ip
        self.export_path = EXPORT_PATH
        self.register_outputs({"private_ip": self.private_ip, "export_path": EXPORT_PATH})
