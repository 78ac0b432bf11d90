"""The one table of InfiniBand GPU sizes: what config, Slurm and NCCL need to know about each.

NCCL/UCX sources: Azure/azhpc-images (components/setup_sku_customizations.sh and
customizations/ndv4.sh, ndv5.sh). The ubuntu-hpc image copies the topology files to
/opt/microsoft/ndv{4,5}-topo.xml, maps both ND H100 v5 and ND H200 v5 to the ndv5 customization,
and sets NCCL_IB_PCI_RELAXED_ORDERING, NCCL_TOPO_FILE and NCCL_IGNORE_CPU_AFFINITY on ND v4/v5.
Its azure_persistent_rdma_naming service names InfiniBand HCAs mlx5_ib0.. (and the
accelerated-networking NIC mlx5_an0), so mlx5_ib0 is the first IB port on every size here.

vCPUs and memory: Azure's size pages (learn.microsoft.com/azure/virtual-machines/sizes/
gpu-accelerated/nd*-series). Encryption at host: ND96amsr_A100_v4 per the Resource SKUs listing
cited in infra/data/vm_sizes.json, the others as current ND sizes (not cross-checked; that file's
`refresh` command checks a size in a region).

Local NVMe: Azure's size pages (MicrosoftDocs/azure-compute-docs, articles/virtual-machines/sizes/
gpu-accelerated/*-series.md, "Local storage" tab). ND H100 v5 and ND H200 v5 list "Max NVMe Disks 8,
NVMe Disk Size 28 TiB" (8 x 3.5 TiB; an ND H100 v5's lsblk shows 3,840,755,982,336-byte namespaces of
model "Microsoft NVMe Direct Disk"). ND A100 v4 (6,000 GiB) and NDm A100 v4 (6,400 GiB) list one
"temp disk" only, with no NVMe disk count: the count there is not confirmed, so the node takes every
local NVMe disk it finds (nvme_disks=None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from infra.cloud_init.nccl import check_nccl_env
from infra.contract import NVME_MOUNT_PATH

# Slurm drains a node that registers with less memory than its RealMemory. The OS sees a few
# percent less than a size's nominal memory (firmware and kernel reservations), and the OS, docker
# and the page cache need room beside jobs: Slurm schedules this share.
SLURM_MEMORY_SHARE = 0.9

_COMMON_NCCL: dict[str, str] = {
    "NCCL_IB_PCI_RELAXED_ORDERING": "1",
    # eth0 carries NCCL's bootstrap/out-of-band traffic; GPU data goes over NET/IB.
    "NCCL_SOCKET_IFNAME": "eth0",
    "UCX_IB_PCI_RELAXED_ORDERING": "on",
    "UCX_TLS": "rc",
    # MPI traffic on the first IB port; NCCL itself uses every HCA.
    "UCX_NET_DEVICES": "mlx5_ib0:1",
    # WARN keeps logs quiet; set NCCL_DEBUG=INFO for a job to see "NET/IB" in its log.
    "NCCL_DEBUG": "WARN",
    "NCCL_IGNORE_CPU_AFFINITY": "1",
}
_ND_V5_NCCL = {**_COMMON_NCCL, "NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml"}
_ND_V4_NCCL = {**_COMMON_NCCL, "NCCL_TOPO_FILE": "/opt/microsoft/ndv4-topo.xml"}


@dataclass(frozen=True)
class GpuSku:
    """An InfiniBand GPU VM size and what the stack derives from it."""

    gpus_per_node: int
    gpu: str
    vcpus: int
    memory_gib: int
    encryption_at_host: bool  # Azure's EncryptionAtHostSupported capability for the size
    nccl_env: Mapping[str, str]
    # The vCPU quota the size counts against in a region, as `az vm list-usage` names it (the Resource
    # SKUs API's `family`); every node takes `vcpus` of it. docs/deploy.md's quota table lists them.
    quota_family: str
    # Local NVMe disks the size has; None: not confirmed, the node uses every one it finds.
    nvme_disks: int | None = None
    nvme_mount: str = NVME_MOUNT_PATH

    def __post_init__(self) -> None:
        # A bad table entry fails at import, not halfway through rendering a node's cloud-init.
        object.__setattr__(self, "nccl_env", MappingProxyType(check_nccl_env(self.nccl_env)))

    @property
    def slurm_real_memory_mb(self) -> int:
        return int(self.memory_gib * 1024 * SLURM_MEMORY_SHARE)


# InfiniBand-connected GPU sizes only: the training stack assumes RDMA between nodes.
GPU_SKUS: dict[str, GpuSku] = {
    "Standard_ND96isr_H200_v5": GpuSku(
        8, "H200", 96, 1850, encryption_at_host=True, nccl_env=_ND_V5_NCCL,
        quota_family="standardNDISRH200V5Family", nvme_disks=8,
    ),
    "Standard_ND96isr_H100_v5": GpuSku(
        8, "H100", 96, 1900, encryption_at_host=True, nccl_env=_ND_V5_NCCL,
        quota_family="standardNDSH100v5Family", nvme_disks=8,
    ),
    "Standard_ND96amsr_A100_v4": GpuSku(
        8, "A100 80GB", 96, 1900, encryption_at_host=True, nccl_env=_ND_V4_NCCL,
        quota_family="standardNDAMSv4_A100Family",
    ),
    "Standard_ND96asr_v4": GpuSku(
        8, "A100 40GB", 96, 900, encryption_at_host=True, nccl_env=_ND_V4_NCCL,
        quota_family="standardNDASv4_A100Family",
    ),
}  # fmt: skip
