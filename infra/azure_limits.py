"""Azure's documented lists that stack config is checked against, read from infra/data/.

Each file names its source, the date it was taken and the command that refreshes it: Azure adds
regions and sizes, and a value missing from a list is refused until the list catches up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class VmSize:
    """What config must know about a jumpbox or NFS server size."""

    max_data_disks: int
    encryption_at_host: bool


def _load(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


AZURE_REGIONS: frozenset[str] = frozenset(_load("azure_regions.json")["regions"])
RESERVED_ADMIN_USERS: frozenset[str] = frozenset(_load("reserved_admin_users.json")["names"])
VM_SIZES: dict[str, VmSize] = {
    name: VmSize(max_data_disks=size["maxDataDisks"], encryption_at_host=size["encryptionAtHost"])
    for family in _load("vm_sizes.json")["families"].values()
    for name, size in family["sizes"].items()
}
