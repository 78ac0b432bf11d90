"""Stack configuration: typed, validated in full before any resource is declared.

Keys are read from the project's Pulumi config namespace in camelCase (``pulumi config set
nodeCount 4``). Every problem is reported at once, each naming the key, the value given and what
is allowed, so that a user fixes a stack file in one pass.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails

from infra.azure_limits import (
    AMLFS_SKUS,
    AUTONAME_SUFFIX_LENGTH,
    AZURE_REGIONS,
    COMPUTER_NAME_PREFIX,
    CONTAINER_REGISTRY_NAME,
    KEY_VAULT_NAME,
    LINUX_COMPUTER_NAME,
    RESERVED_ADMIN_USERS,
    STORAGE_ACCOUNT_NAME,
    VM_SIZES,
    AmlfsSku,
    NameRule,
    amlfs_subnet_prefix,
)
from infra.cloud_init.accounting import check_password
from infra.cloud_init.slurm_packages import DEFAULT_SLURM_VERSION, check_slurm_version
from infra.skus import GPU_SKUS, GpuSku
from infra.slurm_time import DEFAULT_JOB_TIME, TIME_SYNTAX, UNLIMITED, check_max_time, check_time_limit, exceeds
from infra.ssh_key import check_public_key
from infra.users import AccountLimits, AccountName, ClusterUser, UsersList, with_uids

OPEN_CIDRS = frozenset({"*", "0.0.0.0/0", "any", "internet"})
# RFC 1918: the only ranges a VNet here may use, and the ones the storage firewall cannot list.
PRIVATE_RANGES = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # RFC 1122 "this host on this network"; never a source
# A public SSH source wider than this (a /16 is 65,536 addresses) is no longer "the operator's
# range" but a slice of the internet, so it needs the same consent as 0.0.0.0/0.
MIN_PUBLIC_SSH_PREFIX = 16
DEFAULT_IMAGE = "microsoft-dsvm:ubuntu-hpc:2204:latest"
IMAGE_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # publisher, offer and sku
# A storage account's ARM id; Azure reads the fixed segments in any case, the name is lower case.
STORAGE_ACCOUNT_ID = re.compile(
    r"/subscriptions/[0-9a-fA-F-]{36}/resourceGroups/[-\w.()]{1,90}/providers/Microsoft\.Storage/"
    r"storageAccounts/(?-i:[a-z0-9]{3,24})",
    re.IGNORECASE,
)
# An Azure Database for MySQL Flexible Server's ARM id; its name is 3-63 lower-case letters, digits and '-'.
MYSQL_SERVER_ID = re.compile(
    r"/subscriptions/[0-9a-fA-F-]{36}/resourceGroups/[-\w.()]{1,90}/providers/Microsoft\.DBforMySQL/"
    r"flexibleServers/(?-i:[a-z0-9][a-z0-9-]{1,61}[a-z0-9])",
    re.IGNORECASE,
)
# Keys whose values are secrets: `pulumi config set --secret`, and never shown in an error.
SECRET_KEYS = frozenset({"accountingMysqlPassword"})
IMAGE_VERSION = re.compile(r"latest|\d+\.\d+\.\d+")  # Azure image versions are major.minor.build
MAX_NODES = 100  # one placement group, hence one InfiniBand fabric, holds at most 100 VMs
# Idle minutes before Slurm deallocates a node (0: never). Below the lower bound, a pause between
# two jobs would cost a GPU VM's restart (10-30 minutes); beyond a day idle, keeping nodes up is a
# choice better made with 0.
MIN_AUTOSTOP_MINUTES = 10
MAX_AUTOSTOP_MINUTES = 1440
MAX_SAS_LIFETIME = timedelta(days=365)  # a leaked read token should not outlive a year
# Staging ImageNet to blob and pulling it onto NFS takes hours; a token that expires the same day
# would stop a staging run midway.
MIN_SAS_LIFETIME = timedelta(days=1)
CLOCK_ALLOWANCE = timedelta(minutes=1)  # "P1D" is turned into a time a moment before it is checked

# The job time limits: how each is checked, and what else it may be.
JOB_TIME_RULES: dict[str | None, tuple[Callable[[str], str], str]] = {
    "default_job_time": (check_time_limit, "; not INFINITE: a job that names no limit ends too"),
    "max_job_time": (check_max_time, f", or {UNLIMITED} (or UNLIMITED) for no cap"),
}

# Tags: the stack sets RESERVED_TAGS on every resource; Azure allows 50 tags per resource, values
# up to 256 characters, compares names case-insensitively and reserves the prefixes below.
RESERVED_TAGS = ("project", "stack", "owner")
RESERVED_TAG_PREFIXES = ("microsoft", "azure", "windows")
TAG_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # also keeps out the <>%&\?/ that Azure refuses
MAX_TAGS = 50
MAX_TAG_VALUE = 256
TAG_NAME_RULES: tuple[tuple[Callable[[str], bool], str], ...] = (
    (lambda name: not TAG_NAME.fullmatch(name), "must be 1-128 letters, digits, '_', '.' or '-'"),
    (lambda name: name.lower() in RESERVED_TAGS, f"are set by the stack itself ({', '.join(RESERVED_TAGS)}; any case)"),
    (
        lambda name: name.lower().startswith(RESERVED_TAG_PREFIXES),
        f"start with a prefix Azure reserves ({', '.join(RESERVED_TAG_PREFIXES)})",
    ),
)

# (key, value, reason): one fault found by a rule that reads several keys.
Fault = tuple[str, Any, str]
# Stands for the random hex digits azure-native appends to a name the program does not give.
AUTONAME_SUFFIX = "0" * AUTONAME_SUFFIX_LENGTH
# Every name the stack derives from namePrefix that Azure limits more tightly than the prefix
# pattern does: (what it names, how it is made from the prefix, Azure's rule, needs Spot nodes).
# infra/stack.py and its components make the same names; tests/infra/test_stack.py checks both agree.
DERIVED_NAMES: tuple[tuple[str, Callable[[str], str], NameRule, bool], ...] = (
    ("the storage account", lambda p: f"{p}sa{AUTONAME_SUFFIX}", STORAGE_ACCOUNT_NAME, False),
    ("the key vault", lambda p: f"{p}kv{AUTONAME_SUFFIX}", KEY_VAULT_NAME, False),
    ("the container registry", lambda p: f"{p}acr{AUTONAME_SUFFIX}", CONTAINER_REGISTRY_NAME, False),
    ("the GPU nodes' computer name prefix", lambda p: f"{p}-gpu-", COMPUTER_NAME_PREFIX, False),
    ("the Spot nodes' computer name prefix", lambda p: f"{p}-spot-", COMPUTER_NAME_PREFIX, True),
    ("a GPU node's host name", lambda p: f"{p}-gpu-000000", LINUX_COMPUTER_NAME, False),
    ("a Spot node's host name", lambda p: f"{p}-spot-000000", LINUX_COMPUTER_NAME, True),
    ("the head node's host name", lambda p: f"{p}-head", LINUX_COMPUTER_NAME, False),
    ("the jumpbox's host name", lambda p: f"{p}-jumpbox", LINUX_COMPUTER_NAME, False),
    ("the NFS server's host name", lambda p: f"{p}-nfs", LINUX_COMPUTER_NAME, False),
)


# keptResultsApproval: how the private endpoint to a kept results account is approved.
KeptResultsApproval = Literal["auto", "manual"]
# sharedStorage: what /shared is on every host (docs/infrastructure.md, "Shared storage: NFS or Lustre").
SharedStorage = Literal["nfs", "lustre"]
# lustreZone: the availability zone of the file system; none in a region without zones.
LustreZone = Literal["1", "2", "3", "none"]
WeekDay = Literal["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
GUID = re.compile(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")
# The keys that configure one kind of shared storage and mean nothing with the other: set with the
# other kind, they are refused rather than silently ignored.
NFS_KEYS = ("nfs_vm_size", "nfs_disk_count", "nfs_disk_size_gb")
LUSTRE_KEYS = (
    "lustre_tier",
    "lustre_capacity_tib",
    "lustre_zone",
    "lustre_maintenance_day",
    "lustre_maintenance_time",
    "lustre_import_data",
    "lustre_hsm_principal_id",
)
# How to find the object id that lustreHsmPrincipalId takes (its app id is the same in every tenant).
HSM_PRINCIPAL_LOOKUP = "az ad sp list --display-name 'HPC Cache Resource Provider' --query '[0].id' -o tsv"


class ConfigError(ValueError):
    """Raised with every invalid key listed, one line each."""


class CrossFieldError(ValueError):
    """Faults from rules over several keys, kept apart so that each is reported under its key."""

    def __init__(self, faults: list[Fault]):
        super().__init__("; ".join(f"{key}: {reason}" for key, _, reason in faults))
        self.faults = faults


@dataclass(frozen=True)
class ImageReference:
    publisher: str
    offer: str
    sku: str
    version: str


class StackConfig(BaseModel):
    """The validated stack configuration. Field names map to camelCase config keys."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    location: str
    name_prefix: str = Field(default="hvd", pattern=r"^[a-z][a-z0-9]{1,9}$")
    # A tag value on every resource: Azure's 256-character limit, and blank is no owner at all.
    owner: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_TAG_VALUE)]
    admin_user: str = Field(default="hpcadmin", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    ssh_public_key: str
    allowed_ssh_cidr: str
    allow_open_ssh: bool = False
    gpu_sku: str = "Standard_ND96isr_H100_v5"
    node_count: int = Field(default=2, ge=1, le=MAX_NODES)
    # A second scale set of the same size as Spot VMs, Slurm's `spot` partition (0: none). Evicted
    # instances are deallocated: they keep their disks and instance ids, and Slurm starts them again.
    spot_node_count: int = Field(default=0, ge=0, le=MAX_NODES)
    spot_eviction_policy: Literal["Deallocate"] = "Deallocate"
    # USD per hour a Spot VM may cost at most (Azure evicts it above that); -1: up to the on-demand price.
    spot_max_price: float = -1
    image: str = DEFAULT_IMAGE
    # The Slurm of the head node and every node, from Microsoft's Slurm repository (its newest package revision
    # of the version, <version>-*, unless the version names one: 25.11.5-2).
    slurm_version: str = DEFAULT_SLURM_VERSION
    vnet_cidr: str = "10.40.0.0/16"
    jumpbox_vm_size: str = "Standard_B2s"
    head_vm_size: str = "Standard_D4s_v5"
    # The head node's OS disk holds the HPC image, Prometheus's 10 GB of retention, the MLflow
    # server's environment and slurmctld's state: the image's own 64 GB leaves too little. Not below
    # those 64 GB (Azure cannot shrink an image's disk); 4095 GB is Azure's largest OS disk.
    head_os_disk_size_gb: int = Field(default=128, ge=64, le=4095)
    # The head node's own data disk, where MariaDB keeps the accounting database (every job's record):
    # a managed disk of its own, kept when a new head node replaces the old one. A job's record is a few
    # KB: 32 GB hold millions. Unused with accountingMysqlServer.
    head_database_disk_size_gb: int = Field(default=32, ge=8, le=32767)
    # An existing Azure Database for MySQL Flexible Server (its resource id) that slurmdbd keeps the
    # accounting records in, instead of MariaDB on the head node: reached over TLS through a private
    # endpoint in the cluster subnet, as the login accountingMysqlUser with accountingMysqlPassword (a
    # secret, which the stack puts in its Key Vault for the head node). The server's owner makes that
    # login, with every right on the database slurm_acct_db.
    accounting_mysql_server: str | None = None
    accounting_mysql_user: str = Field(default="slurmdbd", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    accounting_mysql_password: SecretStr | None = None
    # The shared file system at /shared: an NFS server VM (nfs*), or Azure Managed Lustre (lustre*).
    shared_storage: SharedStorage = "nfs"
    nfs_vm_size: str = "Standard_D16s_v5"
    nfs_disk_count: int = Field(default=4, ge=1, le=32)
    nfs_disk_size_gb: int = Field(default=1024, ge=32, le=32767)
    # Lustre: the tier, by its rated MB/s per TiB (infra/data/amlfs_skus.json), and the capacity, which the
    # tier bounds and steps; no default, as the capacity is most of the file system's price.
    lustre_tier: int = 125
    lustre_capacity_tib: int | None = None
    lustre_zone: LustreZone = "1"
    # The weekly 30-minute window in which Azure may service the file system (I/O may stall then).
    lustre_maintenance_day: WeekDay = "Sunday"
    lustre_maintenance_time: str = Field(default="02:00", pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")
    # Import the `data` container into the file system (Lustre HSM), at its creation: the container's
    # datasets appear under /shared without a copy. It costs shared-key access on the storage account
    # and two roles there for Azure's HPC Cache Resource Provider, whose object id in this tenant is
    # lustreHsmPrincipalId (infra/lustre.py says why each is needed).
    lustre_import_data: bool = False
    lustre_hsm_principal_id: str | None = None
    # Encrypts the temp disks and the host-side disk caches, which Azure's default encryption of
    # managed disks leaves out. Needs the subscription's Microsoft.Compute/EncryptionAtHost feature.
    encryption_at_host: bool = True
    # Purge protection on the Key Vault that holds the munge key: a deleted vault cannot be purged
    # before its retention ends. Off only for throwaway stacks (docs/infrastructure.md, "Key Vault").
    key_vault_purge_protection: bool = True
    autostop_minutes: int = 30
    # Every partition's DefaultTime and MaxTime, in Slurm's time syntax (maxJobTime: INFINITE for no cap).
    default_job_time: str = DEFAULT_JOB_TIME
    max_job_time: str = UNLIMITED
    sas_expiry: datetime
    # The resource id of a storage account kept by an earlier stack whose `results` container this
    # cluster writes instead of its own (infra/kept_results.py): None, the stack's own account.
    kept_results_account: str | None = None
    # How the private endpoint to that account is approved: auto, at once, which Azure allows only to a
    # deployer holding the account's privateEndpointConnectionsApproval/action; manual, a request that
    # the account's owner approves after the deploy (infra/kept_results.py).
    kept_results_approval: KeptResultsApproval = "auto"
    tags: dict[str, str] = Field(default_factory=dict)
    # The cluster's people (name, sshPublicKey, account, optional uid and limits): the list the head node
    # keeps starts as this one; `dtrain users` changes it on the running cluster (infra/users.py).
    users: list[ClusterUser] = Field(default_factory=list)
    # Limits of whole Slurm accounts (maxGpus, gpuHours: all their members' jobs together), by account name;
    # `dtrain users limit-account` changes them on the running cluster.
    accounts: dict[AccountName, AccountLimits] = Field(default_factory=dict)

    @field_validator("location")
    @classmethod
    def _region(cls, value: str) -> str:
        if value in AZURE_REGIONS:
            return value
        guess = value.lower().replace(" ", "")
        hint = f"; did you mean {guess!r}?" if guess in AZURE_REGIONS else ""
        raise ValueError(f"must be an Azure region name such as 'eastus' (see infra/data/azure_regions.json){hint}")

    @field_validator("lustre_tier")
    @classmethod
    def _lustre_tier(cls, value: int) -> int:
        if value not in AMLFS_SKUS:
            tiers = ", ".join(str(tier) for tier in sorted(AMLFS_SKUS))
            raise ValueError(f"must be one of the Azure Managed Lustre tiers {tiers} (MB/s per TiB)")
        return value

    @field_validator("lustre_hsm_principal_id")
    @classmethod
    def _hsm_principal(cls, value: str | None) -> str | None:
        if value is None or GUID.fullmatch(value):
            return value
        raise ValueError(f"must be a service principal's object id (a GUID): `{HSM_PRINCIPAL_LOOKUP}`")

    @field_validator("kept_results_account")
    @classmethod
    def _kept_account(cls, value: str | None) -> str | None:
        if value is None or STORAGE_ACCOUNT_ID.fullmatch(value):
            return value
        raise ValueError(
            "must be a storage account's resource id, /subscriptions/<subscription id>/resourceGroups/<group>/"
            "providers/Microsoft.Storage/storageAccounts/<name> (`az storage account show -n NAME --query id`)"
        )

    @field_validator("accounting_mysql_server")
    @classmethod
    def _mysql_server(cls, value: str | None) -> str | None:
        if value is None or MYSQL_SERVER_ID.fullmatch(value):
            return value
        raise ValueError(
            "must be an Azure Database for MySQL Flexible Server's resource id, /subscriptions/<subscription id>/"
            "resourceGroups/<group>/providers/Microsoft.DBforMySQL/flexibleServers/<name> "
            "(`az mysql flexible-server show -g GROUP -n NAME --query id`)"
        )

    @field_validator("accounting_mysql_password")
    @classmethod
    def _mysql_password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_password(value.get_secret_value())
        return value

    @field_validator("admin_user")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED_ADMIN_USERS:
            raise ValueError(f"is reserved by Azure; choose another name than {value!r}")
        return value

    @field_validator("ssh_public_key")
    @classmethod
    def _ssh_key(cls, value: str) -> str:
        return check_public_key(value)

    @field_validator("allowed_ssh_cidr")
    @classmethod
    def _cidr(cls, value: str) -> str:
        if value.strip().lower() in OPEN_CIDRS:
            return "0.0.0.0/0"
        try:
            network = ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            raise ValueError(f"must be an IPv4 CIDR such as 203.0.113.7/32 ({exc})") from None
        if kind := _never_a_source(network):
            raise ValueError(f"is {kind}, which no SSH client connects from; give your own public address range")
        return str(network)

    @field_validator("gpu_sku")
    @classmethod
    def _sku(cls, value: str) -> str:
        if value not in GPU_SKUS:
            raise ValueError(f"must be one of the InfiniBand GPU sizes {sorted(GPU_SKUS)}")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        parts = value.split(":")
        if len(parts) != 4:
            raise ValueError("must be publisher:offer:sku:version")
        *names, version = parts
        if not all(IMAGE_NAME_PART.fullmatch(name) for name in names):
            raise ValueError("publisher, offer and sku must be letters, digits, '.', '_' or '-' (no spaces)")
        if not IMAGE_VERSION.fullmatch(version):
            raise ValueError("version must be 'latest' or major.minor.build, e.g. 22.04.2024102301")
        return value

    @field_validator("slurm_version")
    @classmethod
    def _slurm_version(cls, value: str) -> str:
        return check_slurm_version(value)

    @field_validator("vnet_cidr")
    @classmethod
    def _vnet(cls, value: str) -> str:
        try:
            network = ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            raise ValueError(f"must be an IPv4 CIDR ({exc})") from None
        if not _is_private(network) or not 8 <= network.prefixlen <= 22:
            raise ValueError("must be a private (RFC 1918) range between /8 and /22, e.g. 10.40.0.0/16")
        return str(network)

    @field_validator("spot_eviction_policy", mode="before")
    @classmethod
    def _eviction(cls, value: str) -> str:
        # Slurm's names are fixed instance ids (infra/cluster.py) and the power program can only
        # start and deallocate them: a deleted instance is never made again, its name points at an
        # instance id that no longer exists, and the node stays DOWN for good.
        if value == "Delete":
            raise ValueError(
                "is not supported: a deleted Spot instance never comes back under its Slurm name "
                "(the power program starts and deallocates instances, it does not re-create them), "
                "so the node would stay DOWN for good; use Deallocate"
            )
        return value

    @field_validator("spot_max_price")
    @classmethod
    def _max_price(cls, value: float) -> float:
        # Azure takes -1 or a positive price with at most 5 decimals
        if value != -1 and not (value > 0 and round(value, 5) == value):
            raise ValueError(
                "must be -1 (pay up to the on-demand price) or a positive USD price with at most 5 decimals"
            )
        return value

    @field_validator("autostop_minutes")
    @classmethod
    def _autostop(cls, value: int) -> int:
        if value != 0 and not MIN_AUTOSTOP_MINUTES <= value <= MAX_AUTOSTOP_MINUTES:
            raise ValueError(
                f"must be 0 (never stop idle nodes) or {MIN_AUTOSTOP_MINUTES} to {MAX_AUTOSTOP_MINUTES} minutes"
            )
        return value

    @field_validator("default_job_time", "max_job_time")
    @classmethod
    def _job_time(cls, value: str, info: ValidationInfo) -> str:
        check, allowed = JOB_TIME_RULES[info.field_name]
        try:
            return check(value)
        except ValueError:
            raise ValueError(f"must be in {TIME_SYNTAX}{allowed}") from None

    @field_validator("jumpbox_vm_size", "head_vm_size", "nfs_vm_size")
    @classmethod
    def _known_size(cls, value: str) -> str:
        if value not in VM_SIZES:
            raise ValueError(
                "is not in infra/data/vm_sizes.json, so its data-disk limit and encryption-at-host support are "
                f"unknown; use one of {', '.join(VM_SIZES)}, or add it there"
            )
        return value

    @field_validator("sas_expiry", mode="before")
    @classmethod
    def _duration_from_now(cls, value: Any) -> Any:
        """An ISO 8601 duration ("P30D") counts from now: each `pulumi up` rolls the SAS forward."""
        if isinstance(value, str) and value.upper().startswith("P"):
            return datetime.now(UTC) + TypeAdapter(timedelta).validate_python(value)
        return value

    @field_validator("sas_expiry")
    @classmethod
    def _future(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        now = datetime.now(UTC)
        if value <= now:
            raise ValueError("is already past; give a future ISO 8601 time or a duration such as P30D")
        if value < now + MIN_SAS_LIFETIME - CLOCK_ALLOWANCE:
            raise ValueError(
                f"is less than {MIN_SAS_LIFETIME.days} day away; staging a dataset takes hours, give at least P1D"
            )
        if value > now + MAX_SAS_LIFETIME:
            raise ValueError(f"is more than {MAX_SAS_LIFETIME.days} days away; a read token should expire sooner")
        return value.astimezone(UTC)

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: dict[str, str]) -> dict[str, str]:
        if problems := _tag_problems(value):
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _across_keys(self) -> StackConfig:
        faults = [
            *self._ssh_range_faults(),
            *self._nfs_disk_faults(),
            *self._encryption_faults(),
            *self._job_time_faults(),
            *self._derived_name_faults(),
            *self._kept_results_faults(),
            *self._accounting_faults(),
            *self._users_faults(),
            *self._shared_storage_faults(),
        ]
        if faults:
            raise CrossFieldError(faults)
        return self

    def _ssh_range_faults(self) -> list[Fault]:
        network = ipaddress.IPv4Network(self.allowed_ssh_cidr)
        wide = network.prefixlen < MIN_PUBLIC_SSH_PREFIX and not _is_private(network)
        if wide and not self.allow_open_ssh:
            exposure = (
                "opens the jumpbox's SSH to the internet"
                if network.prefixlen == 0
                else f"admits {network.num_addresses:,} public addresses (wider than /{MIN_PUBLIC_SSH_PREFIX})"
            )
            reason = f"{exposure}; set allowOpenSsh true to accept that, or give your own address range"
            return [("allowedSshCidr", self.allowed_ssh_cidr, reason)]
        # An open range the user consented to covers the VNet by design; any other overlap is a mistake.
        if not wide and network.overlaps(ipaddress.IPv4Network(self.vnet_cidr)):
            reason = f"overlaps vnetCidr {self.vnet_cidr}; give the operator's range outside the VNet, or move the VNet"
            return [("allowedSshCidr", self.allowed_ssh_cidr, reason)]
        return []

    def _nfs_disk_faults(self) -> list[Fault]:
        if self.shared_storage != "nfs":
            return []
        limit = VM_SIZES[self.nfs_vm_size].max_data_disks
        if self.nfs_disk_count <= limit:
            return []
        reason = f"nfsVmSize {self.nfs_vm_size} holds at most {limit} data disks; lower the count or pick a larger size"
        return [("nfsDiskCount", self.nfs_disk_count, reason)]

    def _encryption_faults(self) -> list[Fault]:
        if not self.encryption_at_host:
            return []
        supported = {
            "jumpboxVmSize": (self.jumpbox_vm_size, VM_SIZES[self.jumpbox_vm_size].encryption_at_host),
            "headVmSize": (self.head_vm_size, VM_SIZES[self.head_vm_size].encryption_at_host),
            "nfsVmSize": (self.nfs_vm_size, VM_SIZES[self.nfs_vm_size].encryption_at_host),
            "gpuSku": (self.gpu_sku, self.sku.encryption_at_host),
        }
        if self.shared_storage != "nfs":
            del supported["nfsVmSize"]
        reason = "does not support encryption at host; choose a size that does, or set encryptionAtHost false"
        return [(key, size, reason) for key, (size, ok) in supported.items() if not ok]

    def _users_faults(self) -> list[Fault]:
        try:
            with_uids(self.users, self.admin_user, self.accounts)
        except ValidationError as exc:  # the list's own rule: names and uids unique
            return [("users", [user.name for user in self.users], exc.errors()[0]["msg"].removeprefix("Value error, "))]
        except ValueError as exc:
            return [("users", [user.name for user in self.users], str(exc))]
        members = {user.account for user in self.users}
        reason = "no one in users is in this account: its limits would cap nobody (a typo?)"
        return [(f"accounts.{name}", name, reason) for name in sorted(self.accounts.keys() - members)]

    @property
    def users_list(self) -> UsersList:
        """The stack config's people with their uids: what the head node's list starts as."""
        return with_uids(self.users, self.admin_user, self.accounts)

    def _job_time_faults(self) -> list[Fault]:
        if not exceeds(self.default_job_time, self.max_job_time):
            return []
        reason = (
            f"is longer than maxJobTime {self.max_job_time}, the longest a job may run; "
            "lower defaultJobTime or raise maxJobTime"
        )
        return [("defaultJobTime", self.default_job_time, reason)]

    def _kept_results_faults(self) -> list[Fault]:
        if self.kept_results_approval == "auto" or self.kept_results_account:
            return []
        reason = "approves the private endpoint to a kept account, and does nothing without keptResultsAccount"
        return [("keptResultsApproval", self.kept_results_approval, reason)]

    def _accounting_faults(self) -> list[Fault]:
        if self.accounting_mysql_server and self.accounting_mysql_password is None:
            reason = "needs accountingMysqlPassword (`pulumi config set --secret accountingMysqlPassword ...`)"
            return [("accountingMysqlServer", self.accounting_mysql_server, reason)]
        if self.accounting_mysql_password is not None and not self.accounting_mysql_server:
            reason = "is the password of accountingMysqlServer's login, and does nothing without accountingMysqlServer"
            return [("accountingMysqlPassword", "(secret)", reason)]
        return []

    def _shared_storage_faults(self) -> list[Fault]:
        """The keys of the other kind of shared storage, and Lustre's size, subnet and import rules."""
        other, kind = (LUSTRE_KEYS, "lustre") if self.shared_storage == "nfs" else (NFS_KEYS, "nfs")
        reason = f"applies to sharedStorage {kind} only, and this stack's is {self.shared_storage}: remove it, or "
        reason += f"set sharedStorage {kind}"
        given = [key for key in other if key in self.model_fields_set]
        faults: list[Fault] = [(to_camel(key), getattr(self, key), reason) for key in given]
        if self.shared_storage == "lustre":
            faults += self._lustre_size_faults() + self._lustre_import_faults()
        return faults

    def _lustre_size_faults(self) -> list[Fault]:
        """The capacity against the tier's sizes, and the file system's subnet against that capacity."""
        sku, capacity = self.lustre_sku, self.lustre_capacity_tib
        sizes = f"tier {sku.mb_per_second_per_tib} ({sku.name}) takes {sku.sizes()}"
        if capacity is None:
            return [("lustreCapacityTib", None, f"required with sharedStorage lustre: {sizes}")]
        if not sku.admits(capacity):
            return [("lustreCapacityTib", capacity, sizes)]
        needed, subnet = amlfs_subnet_prefix(capacity), ipaddress.IPv4Network(self.subnets["lustre"])
        if subnet.prefixlen <= needed:
            return []
        reason = (
            f"needs a /{needed} subnet or larger (Azure's sizing for {capacity} TiB), and the file system's "
            f"subnet, the last quarter of vnetCidr {self.vnet_cidr}, is {subnet}: give a vnetCidr of /{needed - 2} "
            "or larger, or a smaller capacity"
        )
        return [("lustreCapacityTib", capacity, reason)]

    def _lustre_import_faults(self) -> list[Fault]:
        if self.lustre_import_data and self.lustre_hsm_principal_id is None:
            reason = (
                "required with lustreImportData true: the object id of Azure's HPC Cache Resource Provider in this "
                f"tenant, which gets two roles on the storage account (`{HSM_PRINCIPAL_LOOKUP}`)"
            )
            return [("lustreHsmPrincipalId", None, reason)]
        if not self.lustre_import_data and self.lustre_hsm_principal_id is not None:
            reason = "is granted roles on the storage account for the import, and does nothing without lustreImportData"
            return [("lustreHsmPrincipalId", self.lustre_hsm_principal_id, reason)]
        return []

    def _derived_name_faults(self) -> list[Fault]:
        """Names made from namePrefix that Azure would refuse, found here rather than midway through
        `pulumi up` (a refused scale set leaves the deployment half made)."""
        broken = [
            f"{what} {name!r} ({len(name)} characters; Azure allows {rule.allowed})"
            for what, name, rule in self._derived_names(self.name_prefix)
            if not rule.admits(name)
        ]
        if not broken:
            return []
        fits = [
            n
            for n in range(len(self.name_prefix), 0, -1)
            if all(rule.admits(name) for _, name, rule in self._derived_names(self.name_prefix[:n]))
        ]
        advice = f"give a namePrefix of at most {fits[0]} characters" if fits else "give a shorter namePrefix"
        if any("Spot" in text for text in broken):
            advice += " while spotNodeCount is above 0"
        reason = f"makes {'; '.join(broken)}; {advice}"
        return [("namePrefix", self.name_prefix, reason)]

    def _derived_names(self, prefix: str) -> list[tuple[str, str, NameRule]]:
        spot = self.spot_node_count > 0
        return [(what, make(prefix), rule) for what, make, rule, needs_spot in DERIVED_NAMES if spot or not needs_spot]

    @property
    def derived_names(self) -> dict[str, str]:
        """What each name made from namePrefix will be (random suffixes as zeros)."""
        return {what: name for what, name, _ in self._derived_names(self.name_prefix)}

    # Derived values: pure functions of the validated fields, so never stored twice.

    @property
    def sku(self) -> GpuSku:
        return GPU_SKUS[self.gpu_sku]

    @property
    def image_reference(self) -> ImageReference:
        return ImageReference(*self.image.split(":"))

    @property
    def lustre_sku(self) -> AmlfsSku:
        return AMLFS_SKUS[self.lustre_tier]

    @property
    def subnets(self) -> dict[str, str]:
        """Quarter the VNet: cluster, the NFS server (sharedStorage nfs), jumpbox, and the Lustre file system
        (sharedStorage lustre: Azure wants a subnet of its own for it)."""
        quarters = [str(q) for q in ipaddress.IPv4Network(self.vnet_cidr).subnets(prefixlen_diff=2)]
        storage = {"nfs": quarters[1]} if self.shared_storage == "nfs" else {"lustre": quarters[3]}
        return {"cluster": quarters[0], **storage, "jumpbox": quarters[2]}

    @property
    def nfs_private_ip(self) -> str:
        # Azure reserves the first four addresses of a subnet.
        return str(ipaddress.IPv4Network(self.subnets["nfs"]).network_address + 4)

    @property
    def head_private_ip(self) -> str:
        """The last usable address of the cluster subnet (Azure reserves the broadcast address):
        the scale set takes its dynamic addresses from the bottom, so the two never collide."""
        return str(ipaddress.IPv4Network(self.subnets["cluster"]).broadcast_address - 1)

    def resource_tags(self, project: str, stack: str) -> dict[str, str]:
        return {**self.tags, **dict(zip(RESERVED_TAGS, (project, stack, self.owner), strict=True))}


def _is_private(network: ipaddress.IPv4Network) -> bool:
    return any(network.subnet_of(private) for private in PRIVATE_RANGES)


def _never_a_source(network: ipaddress.IPv4Network) -> str | None:
    """Name the special-purpose range a CIDR lies in, if it lies in one no packet comes from."""
    kinds = {
        "loopback": network.is_loopback,
        "link-local": network.is_link_local,
        "multicast": network.is_multicast,
        "reserved (240.0.0.0/4)": network.is_reserved,
        "in 0.0.0.0/8 (this network)": network.subnet_of(THIS_NETWORK),
    }
    return next((kind for kind, hit in kinds.items() if hit), None)


def _tag_problems(tags: Mapping[str, str]) -> list[str]:
    problems = [
        f"tag names {bad} {rule}" for test, rule in TAG_NAME_RULES if (bad := [name for name in tags if test(name)])
    ]
    folded = Counter(name.lower() for name in tags)
    if twins := [name for name in tags if folded[name.lower()] > 1]:
        problems.append(f"tag names {twins} differ only in case, and Azure ignores case in tag names")
    if long := [name for name, value in tags.items() if len(value) > MAX_TAG_VALUE]:
        problems.append(f"the values of {long} are longer than Azure's {MAX_TAG_VALUE} characters")
    if len(tags) + len(RESERVED_TAGS) > MAX_TAGS:
        problems.append(
            f"{len(tags)} tags plus the stack's {len(RESERVED_TAGS)} exceed Azure's {MAX_TAGS} tags per resource"
        )
    return problems


def parse_config(raw: Mapping[str, Any], namespace: str = "") -> StackConfig:
    """Validate raw config values (camelCase keys) or raise one ConfigError listing every fault."""
    try:
        return StackConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, raw, namespace)) from None


def _describe(exc: ValidationError, raw: Mapping[str, Any], namespace: str) -> str:
    prefix = f"{namespace}:" if namespace else ""
    lines = [f"  {prefix}{key}: {text}" for error in exc.errors() for key, text in _explain(error, raw)]
    return "\n".join(["invalid stack configuration:", *lines])


def _explain(error: ErrorDetails, raw: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, what is wrong) for one pydantic error; a rule across keys may report several."""
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, CrossFieldError):
        return [(key, f"got {_shown(raw.get(key, value), key)}; {reason}") for key, value, reason in cause.faults]
    key = str(error["loc"][0])
    if error["type"] == "missing":
        return [(key, f"required; set it with `pulumi config set {key} ...`")]
    path = key + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"][1:])
    if error["type"] == "extra_forbidden":  # inside a list or map (a user of `users`): named down to the field
        given = _shown(error.get("input")) if len(error["loc"]) > 1 else _shown(raw.get(key), key)
        return [(path, f"unknown key (given {given})")]
    reason = error["msg"].removeprefix("Value error, ")
    if len(error["loc"]) > 1:
        return [(path, f"got {_shown(error.get('input'))}; {reason}")]
    return [(key, f"got {_shown(raw.get(key), key)}; {reason}")]


def _shown(value: Any, key: str = "", limit: int = 120) -> str:
    """The value as given, cut short when long (an RSA key, a big tag map) so the reason stays readable;
    a secret's never."""
    if key in SECRET_KEYS:
        return "a secret (not shown)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} characters)"


def config_keys() -> list[str]:
    """The camelCase keys the program reads, in declaration order."""
    return [field.alias or name for name, field in StackConfig.model_fields.items()]


def structured_keys() -> frozenset[str]:
    """The keys whose values are maps or lists (YAML structures in the stack file), not strings."""
    fields = StackConfig.model_fields.items()
    return frozenset(field.alias or name for name, field in fields if get_origin(field.annotation) in (list, dict))


def load_config() -> StackConfig:
    """Read this project's keys from the Pulumi config and validate them."""
    import pulumi  # imported here so that parsing and validation stay usable without Pulumi

    config = pulumi.Config()
    raw: dict[str, Any] = {}
    for key in config_keys():
        # a map or a list in the stack file (tags, users, accounts) is JSON text to config.get
        value = config.get_object(key) if key in structured_keys() else config.get(key)
        if value is not None:
            raw[key] = value
    if plain := [key for key in SECRET_KEYS & raw.keys() if not pulumi.runtime.is_config_secret(config.full_key(key))]:
        keys = ", ".join(sorted(plain))
        raise ConfigError(
            f"invalid stack configuration:\n  {keys}: is stored in plain text in the stack file; set it again with "
            f"`pulumi config set --secret {sorted(plain)[0]} ...`"
        )
    return parse_config(raw, pulumi.get_project())
