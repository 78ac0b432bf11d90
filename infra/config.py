"""Stack configuration: typed, validated in full before any resource is declared.

Keys are read from the project's Pulumi config namespace in camelCase (``pulumi config set
nodeCount 4``). Every problem is reported at once, each naming the key, the value given and what
is allowed, so that a user fixes a stack file in one pass.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class GpuSku:
    """An InfiniBand GPU VM size and what the launcher needs to know about it."""

    gpus_per_node: int
    gpu: str


# InfiniBand-connected GPU sizes only: the training stack assumes RDMA between nodes.
GPU_SKUS: dict[str, GpuSku] = {
    "Standard_ND96isr_H200_v5": GpuSku(8, "H200"),
    "Standard_ND96isr_H100_v5": GpuSku(8, "H100"),
    "Standard_ND96amsr_A100_v4": GpuSku(8, "A100 80GB"),
    "Standard_ND96asr_v4": GpuSku(8, "A100 40GB"),
}

# Azure rejects these Linux admin user names.
RESERVED_ADMIN_USERS = frozenset(
    {"admin", "administrator", "root", "user", "guest", "test", "azureuser", "sys", "support"}
)
OPEN_CIDRS = frozenset({"*", "0.0.0.0/0", "any", "internet"})
SSH_KEY_TYPES = ("ssh-rsa", "ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384")
DEFAULT_IMAGE = "microsoft-dsvm:ubuntu-hpc:2204:latest"
MAX_NODES = 100  # one placement group, hence one InfiniBand fabric, holds at most 100 VMs
MAX_SAS_LIFETIME = timedelta(days=365)  # a leaked read token should not outlive a year


class ConfigError(ValueError):
    """Raised with every invalid key listed, one line each."""


@dataclass(frozen=True)
class ImageReference:
    publisher: str
    offer: str
    sku: str
    version: str


class StackConfig(BaseModel):
    """The validated stack configuration. Field names map to camelCase config keys."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    location: str = Field(pattern=r"^[a-z][a-z0-9]+$")
    name_prefix: str = Field(default="hvd", pattern=r"^[a-z][a-z0-9]{1,9}$")
    owner: str = Field(min_length=1, max_length=256)
    admin_user: str = Field(default="hpcadmin", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    ssh_public_key: str
    allowed_ssh_cidr: str
    allow_open_ssh: bool = False
    gpu_sku: str = "Standard_ND96isr_H100_v5"
    node_count: int = Field(default=2, ge=1, le=MAX_NODES)
    image: str = DEFAULT_IMAGE
    vnet_cidr: str = "10.40.0.0/16"
    jumpbox_vm_size: str = Field(default="Standard_B2s", pattern=r"^Standard_[A-Za-z0-9_]+$")
    nfs_vm_size: str = Field(default="Standard_D16s_v5", pattern=r"^Standard_[A-Za-z0-9_]+$")
    nfs_disk_count: int = Field(default=4, ge=1, le=32)
    nfs_disk_size_gb: int = Field(default=1024, ge=32, le=32767)
    sas_expiry: datetime
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("admin_user")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED_ADMIN_USERS:
            raise ValueError(f"is reserved by Azure; choose another name than {value!r}")
        return value

    @field_validator("ssh_public_key")
    @classmethod
    def _ssh_key(cls, value: str) -> str:
        parts = value.split()
        if len(parts) < 2 or parts[0] not in SSH_KEY_TYPES:
            raise ValueError(f"must be an OpenSSH public key starting with one of {SSH_KEY_TYPES}")
        return value.strip()

    @field_validator("allowed_ssh_cidr")
    @classmethod
    def _cidr(cls, value: str) -> str:
        if value.strip().lower() in OPEN_CIDRS:
            return "0.0.0.0/0"
        try:
            return str(ipaddress.IPv4Network(value, strict=True))
        except ValueError as exc:
            raise ValueError(f"must be an IPv4 CIDR such as 203.0.113.7/32 ({exc})") from None

    @field_validator("gpu_sku")
    @classmethod
    def _sku(cls, value: str) -> str:
        if value not in GPU_SKUS:
            raise ValueError(f"must be one of the InfiniBand GPU sizes {sorted(GPU_SKUS)}")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if len(value.split(":")) != 4 or not all(value.split(":")):
            raise ValueError("must be publisher:offer:sku:version")
        return value

    @field_validator("vnet_cidr")
    @classmethod
    def _vnet(cls, value: str) -> str:
        try:
            network = ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            raise ValueError(f"must be an IPv4 CIDR ({exc})") from None
        if not network.is_private or not 8 <= network.prefixlen <= 22:
            raise ValueError("must be a private range between /8 and /22")
        return str(network)

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
        if value > now + MAX_SAS_LIFETIME:
            raise ValueError(f"is more than {MAX_SAS_LIFETIME.days} days away; a read token should expire sooner")
        return value.astimezone(UTC)

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [key for key in value if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", key)]
        if bad:
            raise ValueError(f"tag names must be 1-128 letters, digits, '_', '.', '-': {bad}")
        return value

    @model_validator(mode="after")
    def _open_ssh_needs_consent(self) -> StackConfig:
        if self.allowed_ssh_cidr == "0.0.0.0/0" and not self.allow_open_ssh:
            raise ValueError(
                "allowedSshCidr: 0.0.0.0/0 opens the jumpbox's SSH to the internet; "
                "set allowOpenSsh true to accept that, or give your own address range"
            )
        return self

    # Derived values: pure functions of the validated fields, so never stored twice.

    @property
    def sku(self) -> GpuSku:
        return GPU_SKUS[self.gpu_sku]

    @property
    def image_reference(self) -> ImageReference:
        return ImageReference(*self.image.split(":"))

    @property
    def subnets(self) -> dict[str, str]:
        """Quarter the VNet: cluster, NFS server, jumpbox (the fourth is left for growth)."""
        quarters = list(ipaddress.IPv4Network(self.vnet_cidr).subnets(prefixlen_diff=2))
        return {"cluster": str(quarters[0]), "nfs": str(quarters[1]), "jumpbox": str(quarters[2])}

    @property
    def nfs_private_ip(self) -> str:
        # Azure reserves the first four addresses of a subnet.
        return str(ipaddress.IPv4Network(self.subnets["nfs"]).network_address + 4)

    def resource_tags(self, project: str, stack: str) -> dict[str, str]:
        return {**self.tags, "project": project, "stack": stack, "owner": self.owner}


def parse_config(raw: Mapping[str, Any], namespace: str = "") -> StackConfig:
    """Validate raw config values (camelCase keys) or raise one ConfigError listing every fault."""
    try:
        return StackConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, raw, namespace)) from None


def _describe(exc: ValidationError, raw: Mapping[str, Any], namespace: str) -> str:
    prefix = f"{namespace}:" if namespace else ""
    lines = ["invalid stack configuration:"]
    for error in exc.errors():
        key = str(error["loc"][0]) if error["loc"] else ""
        message = error["msg"].removeprefix("Value error, ")
        if not key:  # model-level rules name their key in the message
            lines.append(f"  {prefix}{message}")
        elif error["type"] == "missing":
            lines.append(f"  {prefix}{key}: required; set it with `pulumi config set {key} ...`")
        elif error["type"] == "extra_forbidden":
            lines.append(f"  {prefix}{key}: unknown key (given {raw.get(key)!r})")
        else:
            lines.append(f"  {prefix}{key}: got {raw.get(key)!r}; {message}")
    return "\n".join(lines)


def config_keys() -> list[str]:
    """The camelCase keys the program reads, in declaration order."""
    return [field.alias or name for name, field in StackConfig.model_fields.items()]


def load_config() -> StackConfig:
    """Read this project's keys from the Pulumi config and validate them."""
    import pulumi  # imported here so that parsing and validation stay usable without Pulumi

    config = pulumi.Config()
    raw: dict[str, Any] = {}
    for key in config_keys():
        value = config.get_object(key) if key == "tags" else config.get(key)
        if value is not None:
            raw[key] = value
    return parse_config(raw, pulumi.get_project())
