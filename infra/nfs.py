"""NFS file server: premium data disks striped as RAID 0, exported to the cluster subnet only."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
from pulumi_azure_native import compute

from infra.cloud_init import remote_file, render_nfs_server
from infra.vm import LinuxVm, LinuxVmArgs, MachineArgs, encode_custom_data

EXPORT_PATH = "/export"
# dtrain/remote/boot/blob_pull.py, shipped onto the server as /usr/local/bin/blob-pull: pulls the
# dataset with the read-only SAS.
BLOB_PULL_SCRIPT = "boot/blob_pull.py"


@dataclass
class NfsServerArgs(MachineArgs):
    private_ip: str
    cluster_cidr: str
    disk_count: int
    disk_size_gb: int


class NfsServer(pulumi.ComponentResource):
    def __init__(self, name: str, args: NfsServerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:NfsServer", name, None, opts)
        cloud_config = render_nfs_server(
            data_disk_count=args.disk_count,
            export_path=EXPORT_PATH,
            allowed_cidr=args.cluster_cidr,
            blob_pull_script=remote_file(BLOB_PULL_SCRIPT),
        )
        self.machine = LinuxVm(
            name,
            LinuxVmArgs(
                **args.machine_fields(),
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
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.private_ip = args.private_ip
        self.export_path = EXPORT_PATH
        self.register_outputs({"private_ip": self.private_ip, "export_path": EXPORT_PATH})
