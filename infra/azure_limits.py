"""Azure's documented lists that stack config is checked against, read from infra/data/.

Each file names its source, the date it was taken and the command that refreshes it: Azure adds
regions and sizes, and a value missing from a list is refused until the list catches up.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class VmSize:
    """What config must know about a jumpbox, head or NFS server size, and what it takes of the quota."""

    max_data_disks: int
    encryption_at_host: bool
    vcpus: int
    quota_family: str  # the regional quota it counts against, as `az vm list-usage` names it


# Azure's naming convention: Standard_<family letters><vCPUs><features>[_<version>] (Standard_D16s_v5:
# 16). The listed sizes follow it; a constrained-vCPU size (Standard_E4-2s_v3) is not listed.
_VCPUS_IN_NAME = re.compile(r"Standard_[A-Z]+(\d+)")


def _vm_size(name: str, size: dict[str, Any], family: dict[str, Any]) -> VmSize:
    vcpus = _VCPUS_IN_NAME.match(name)
    if vcpus is None:
        raise ValueError(f"infra/data/vm_sizes.json: {name} does not name its vCPUs as Azure's sizes do")
    return VmSize(size["maxDataDisks"], size["encryptionAtHost"], int(vcpus[1]), family["quotaFamily"])


def _load(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


AZURE_REGIONS: frozenset[str] = frozenset(_load("azure_regions.json")["regions"])
RESERVED_ADMIN_USERS: frozenset[str] = frozenset(_load("reserved_admin_users.json")["names"])
VM_SIZES: dict[str, VmSize] = {
    name: _vm_size(name, size, family)
    for family in _load("vm_sizes.json")["families"].values()
    for name, size in family["sizes"].items()
}


@dataclass(frozen=True)
class AmlfsSku:
    """An Azure Managed Lustre SKU (infra/data/amlfs_skus.json): its name, rated throughput and sizes."""

    name: str  # e.g. AMLFS-Durable-Premium-125
    mb_per_second_per_tib: int
    min_tib: int
    max_tib: int
    step_tib: int

    def sizes(self) -> str:
        """The capacities it takes, in words, for an error."""
        return f"{self.min_tib} to {self.max_tib} TiB in steps of {self.step_tib}"

    def admits(self, capacity_tib: int) -> bool:
        return self.min_tib <= capacity_tib <= self.max_tib and capacity_tib % self.step_tib == 0


_AMLFS = _load("amlfs_skus.json")
# By the tier's rated MB/s per TiB (lustreTier): 40, 125, 250, 500.
AMLFS_SKUS: dict[int, AmlfsSku] = {
    sku["mbPerSecondPerTiB"]: AmlfsSku(name, sku["mbPerSecondPerTiB"], sku["minTiB"], sku["maxTiB"], sku["stepTiB"])
    for name, sku in _AMLFS["skus"].items()
}
_AMLFS_SUBNETS: tuple[tuple[int, int], ...] = tuple(
    (row["upToTiB"], row["prefixLength"]) for row in _AMLFS["subnetPrefixByCapacity"]
)


def amlfs_subnet_prefix(capacity_tib: int) -> int:
    """The longest subnet prefix (the smallest subnet) that Azure recommends for a file system of this size."""
    return next(prefix for up_to, prefix in _AMLFS_SUBNETS if capacity_tib <= up_to)


# pulumi-azure-native names a resource that is given no name after its logical name plus 8 random
# hex digits (its "random" auto-naming: resource.NewUniqueHex(name, 8, 0), with no cap on the
# length), so a name check counts them.
AUTONAME_SUFFIX_LENGTH = 8


@dataclass(frozen=True)
class NameRule:
    """Azure's rule for one kind of name (its "Naming rules and restrictions" page)."""

    pattern: re.Pattern[str]  # matched in full; carries the length limits
    allowed: str  # the rule in words, for the error

    def admits(self, name: str) -> bool:
        return self.pattern.fullmatch(name) is not None


def _rule(pattern: str, allowed: str) -> NameRule:
    return NameRule(re.compile(pattern), allowed)


# Names that the stack derives from namePrefix and that a prefix the config admits might break.
STORAGE_ACCOUNT_NAME = _rule(r"[a-z0-9]{3,24}", "3-24 lower-case letters and digits")
KEY_VAULT_NAME = _rule(
    r"(?!.*--)[A-Za-z][A-Za-z0-9-]{1,22}[A-Za-z0-9]",
    "3-24 letters, digits and single hyphens, starting with a letter and ending with a letter or digit",
)
CONTAINER_REGISTRY_NAME = _rule(r"[A-Za-z0-9]{5,50}", "5-50 letters and digits")
# A scale set's computerNamePrefix: 1-15 characters (the API's limit); lower case, as Slurm names nodes.
COMPUTER_NAME_PREFIX = _rule(r"[a-z][a-z0-9-]{0,14}", "1-15 lower-case letters, digits and hyphens")
# A Linux VM's computer name (and so its host name): 1-64 characters, not all digits; lower case for Slurm.
LINUX_COMPUTER_NAME = _rule(
    r"(?![0-9]+$)[a-z0-9][a-z0-9-]{0,63}", "1-64 lower-case letters, digits and hyphens, not all digits"
)

# Azure's rule for each resource type the stack declares, by the end of its azure-native type. The
# tests check every declared resource's name against it, under mocks, with the longest namePrefix.
RESOURCE_NAME_RULES: dict[str, NameRule] = {
    ":ResourceGroup": _rule(r"[\w().-]{0,89}[\w()-]", "1-90 letters, digits, _ ( ) - and ., not ending in ."),
    ":VirtualNetwork": _rule(r"[A-Za-z0-9][\w.-]{0,62}[\w]", "2-64 letters, digits, _ . -"),
    ":Subnet": _rule(r"[A-Za-z0-9]([\w.-]{0,78}\w)?", "1-80 letters, digits, _ . -"),
    ":NetworkSecurityGroup": _rule(r"[A-Za-z0-9]([\w.-]{0,78}\w)?", "1-80 letters, digits, _ . -"),
    ":NetworkInterface": _rule(r"[A-Za-z0-9]([\w.-]{0,78}\w)?", "1-80 letters, digits, _ . -"),
    ":PublicIPAddress": _rule(r"[A-Za-z0-9]([\w.-]{0,78}\w)?", "1-80 letters, digits, _ . -"),
    ":ProximityPlacementGroup": _rule(r"[A-Za-z0-9]([\w.-]{0,78}\w)?", "1-80 letters, digits, _ . -"),
    ":UserAssignedIdentity": _rule(r"[A-Za-z0-9][\w-]{2,127}", "3-128 letters, digits, _ and -"),
    ":VirtualMachine": _rule(r"[A-Za-z0-9]([\w.-]{0,62}\w)?", "1-64 letters, digits, _ . -"),
    ":VirtualMachineScaleSet": _rule(r"[A-Za-z0-9]([\w.-]{0,62}\w)?", "1-64 letters, digits, _ . -"),
    ":StorageAccount": STORAGE_ACCOUNT_NAME,
    ":Vault": KEY_VAULT_NAME,
    ":Registry": CONTAINER_REGISTRY_NAME,
    # Azure Managed Lustre: "alphanumerics, underscores, and hyphens; start and end with alphanumeric"
    ":AmlFilesystem": _rule(r"[A-Za-z0-9]([\w-]{0,78}[A-Za-z0-9])?", "1-80 letters, digits, _ and -"),
}
