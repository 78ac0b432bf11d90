"""NCCL/UCX settings per InfiniBand GPU size, and the check that keeps NCCL on InfiniBand.

Sources: Azure/azhpc-images (components/setup_sku_customizations.sh and customizations/ndv4.sh,
ndv5.sh). The ubuntu-hpc image copies the topology files to /opt/microsoft/ndv{4,5}-topo.xml,
maps both ND H100 v5 and ND H200 v5 to the ndv5 customization, and sets
NCCL_IB_PCI_RELAXED_ORDERING, NCCL_TOPO_FILE and NCCL_IGNORE_CPU_AFFINITY on ND v4/v5.
Its azure_persistent_rdma_naming service names InfiniBand HCAs mlx5_ib0.. (and the
accelerated-networking NIC mlx5_an0), so mlx5_ib0 is the first IB port on every size here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_COMMON: dict[str, str] = {
    "NCCL_IB_PCI_RELAXED_ORDERING": "1",
    # eth0 carries NCCL's bootstrap/out-of-band traffic; GPU data goes over NET/IB.
    "NCCL_SOCKET_IFNAME": "eth0",
    "UCX_IB_PCI_RELAXED_ORDERING": "on",
    "UCX_TLS": "rc",
    # MPI traffic on the first IB port; NCCL itself uses every HCA.
    "UCX_NET_DEVICES": "mlx5_ib0:1",
    # WARN keeps logs quiet; set NCCL_DEBUG=INFO for a job to see "NET/IB" in its log.
    "NCCL_DEBUG": "WARN",
}

_ND_V5 = {
    **_COMMON,
    "NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml",
    "NCCL_IGNORE_CPU_AFFINITY": "1",
}
_ND_V4 = {
    **_COMMON,
    "NCCL_TOPO_FILE": "/opt/microsoft/ndv4-topo.xml",
    "NCCL_IGNORE_CPU_AFFINITY": "1",
}

NCCL_ENV_BY_SKU: Mapping[str, Mapping[str, str]] = {
    "Standard_ND96isr_H100_v5": _ND_V5,
    "Standard_ND96isr_H200_v5": _ND_V5,
    "Standard_ND96asr_v4": _ND_V4,
    "Standard_ND96amsr_A100_v4": _ND_V4,
}

_KEY = re.compile(r"[A-Z][A-Z0-9_]*")
# Values go unquoted into /etc/nccl.conf (also a valid `docker --env-file`): no spaces or quotes.
_VALUE = re.compile(r"[A-Za-z0-9_.,:/=^+-]+")


def nccl_env_for_sku(sku: str) -> dict[str, str]:
    """NCCL and UCX settings for an InfiniBand GPU size, e.g. Standard_ND96isr_H100_v5."""
    try:
        return dict(NCCL_ENV_BY_SKU[sku])
    except KeyError:
        raise ValueError(f"no NCCL settings for VM size {sku!r}; known sizes: {sorted(NCCL_ENV_BY_SKU)}") from None


def check_nccl_env(nccl_env: Mapping[str, str]) -> dict[str, str]:
    """Validate settings bound for /etc/nccl.conf; refuse any that would take NCCL off InfiniBand."""
    for key, value in nccl_env.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"nccl_env: {key!r} is not an upper-case environment variable name")
        if not isinstance(value, str) or not _VALUE.fullmatch(value):
            raise ValueError(f"nccl_env: {key}={value!r} must be a non-empty value without spaces or quotes")
    if "NCCL_IB_DISABLE" in nccl_env:
        raise ValueError(
            f"nccl_env: NCCL_IB_DISABLE={nccl_env['NCCL_IB_DISABLE']} is refused: the cluster must use "
            "InfiniBand (NCCL's default); leave NCCL_IB_DISABLE unset"
        )
    if nccl_env.get("NCCL_NET", "IB").upper() != "IB":
        raise ValueError(f"nccl_env: NCCL_NET={nccl_env['NCCL_NET']} would bypass InfiniBand; leave it unset")
    return dict(nccl_env)
