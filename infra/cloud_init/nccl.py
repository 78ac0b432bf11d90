"""The check that keeps NCCL on InfiniBand and keeps /etc/nccl.conf well-formed.

The settings themselves are per GPU size, in the SKU table (infra/skus.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_KEY = re.compile(r"[A-Z][A-Z0-9_]*")
# Values go unquoted into /etc/nccl.conf (also a valid `docker --env-file`): no spaces or quotes.
_VALUE = re.compile(r"[A-Za-z0-9_.,:/=^+-]+")


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
