"""cloud-init documents for the NFS server, the head node and the GPU nodes, rendered by pure functions.

No Pulumi here: plain values in, `#cloud-config` YAML text out, so that tests can validate the
documents with `cloud-init schema` and the embedded shell scripts with shellcheck. slurm.py renders
Slurm's own files and the node health check, for any cluster (Azure's and the local one). The
scripts and programs the documents install are read from dtrain/remote/, where everything that
runs on a cluster host lives.
"""

from infra.cloud_init._common import custom_data_bytes, remote_file
from infra.cloud_init.cluster_node import render_cluster_node
from infra.cloud_init.head_node import render_head_node
from infra.cloud_init.nccl import check_nccl_env
from infra.cloud_init.nfs_server import render_nfs_server
from infra.cloud_init.slurm import render_cgroup_conf, render_gres_conf, render_health_check, render_slurm_conf

__all__ = [
    "check_nccl_env",
    "custom_data_bytes",
    "remote_file",
    "render_cgroup_conf",
    "render_cluster_node",
    "render_gres_conf",
    "render_head_node",
    "render_health_check",
    "render_nfs_server",
    "render_slurm_conf",
]
