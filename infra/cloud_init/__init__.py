"""cloud-init documents for the NFS server and the GPU nodes, rendered by pure functions.

No Pulumi here: plain values in, `#cloud-config` YAML text out, so that tests can validate the
documents with `cloud-init schema` and the embedded shell scripts with shellcheck.
"""

from infra.cloud_init.cluster_node import render_cluster_node
from infra.cloud_init.nccl import check_nccl_env, nccl_env_for_sku
from infra.cloud_init.nfs_server import render_nfs_server

__all__ = ["check_nccl_env", "nccl_env_for_sku", "render_cluster_node", "render_nfs_server"]
