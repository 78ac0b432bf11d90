"""Config validation: every bad value is refused with its key named, before any resource exists."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pulumi
import pytest
import yaml

from infra.cloud_init import nccl_env_for_sku
from infra.config import GPU_SKUS, ConfigError, load_config, parse_config
from infra.stack import build_stack
from tests.infra.azure_mocks import AzureMocks
from tests.infra.conftest import PROJECT, STACK, VALID_CONFIG

YESTERDAY = (datetime.now(UTC) - timedelta(days=1)).isoformat()

BAD_VALUES = [
    ("location", "East US"),
    ("namePrefix", "Bad-Prefix"),
    ("namePrefix", "x" * 11),
    ("owner", ""),
    ("adminUser", "root"),
    ("adminUser", "Has Space"),
    ("sshPublicKey", "not-a-key"),
    ("sshPublicKey", "ssh-dss AAAAB3NzaC1kc3M="),
    ("allowedSshCidr", "10.0.0.300/24"),
    ("allowedSshCidr", "203.0.113.7/24"),  # host bits set: almost always a typo
    ("allowedSshCidr", "0.0.0.0/0"),
    ("allowedSshCidr", "*"),
    ("gpuSku", "Standard_NC6s_v3"),  # a GPU size without InfiniBand
    ("gpuSku", "Standard_D4s_v5"),
    ("nodeCount", "0"),
    ("nodeCount", "101"),
    ("nodeCount", "four"),
    ("nfsDiskCount", "0"),
    ("nfsDiskCount", "33"),
    ("nfsDiskSizeGb", "16"),
    ("nfsVmSize", "D16s_v5"),
    ("jumpboxVmSize", "small"),
    ("sasExpiry", "next tuesday"),
    ("sasExpiry", YESTERDAY),
    ("sasExpiry", "P400D"),  # longer than a year
    ("sasExpiry", "2099-01-01T00:00:00Z"),
    ("image", "microsoft-dsvm:ubuntu-hpc:2204"),
    ("vnetCidr", "8.8.0.0/16"),  # public range
    ("vnetCidr", "10.40.0.0/24"),  # too small to split into role subnets
    ("tags", {"bad key!": "x"}),
    ("allowOpenSsh", "maybe"),
    ("colour", "blue"),  # unknown key: a typo must not be silently ignored
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}"[:60] for k, v in BAD_VALUES])
def test_bad_value_names_key_and_value(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, key: value}, PROJECT)
    message = str(raised.value)
    assert f"{PROJECT}:{key}" in message or f"{PROJECT}:{key}:" in message
    if isinstance(value, str) and value and key != "allowedSshCidr":
        assert repr(value) in message


@pytest.mark.parametrize("key", ["location", "owner", "sshPublicKey", "allowedSshCidr", "sasExpiry"])
def test_required_key_missing(key: str) -> None:
    raw = {k: v for k, v in VALID_CONFIG.items() if k != key}
    with pytest.raises(ConfigError, match=f"{PROJECT}:{key}: required; set it with `pulumi config set {key}"):
        parse_config(raw, PROJECT)


def test_all_faults_reported_at_once() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, "nodeCount": "0", "gpuSku": "Standard_D4s_v5"}, PROJECT)
    assert "nodeCount" in str(raised.value) and "gpuSku" in str(raised.value)


def test_open_ssh_needs_explicit_flag() -> None:
    cfg = parse_config({**VALID_CONFIG, "allowedSshCidr": "*", "allowOpenSsh": "true"})
    assert cfg.allowed_ssh_cidr == "0.0.0.0/0"


def test_valid_config_and_derived_values() -> None:
    cfg = parse_config(VALID_CONFIG)
    assert cfg.node_count == 4 and cfg.sku == GPU_SKUS["Standard_ND96isr_H100_v5"]
    assert cfg.subnets == {"cluster": "10.40.0.0/18", "nfs": "10.40.64.0/18", "jumpbox": "10.40.128.0/18"}
    assert cfg.nfs_private_ip == "10.40.64.4"
    assert cfg.image_reference.publisher == "microsoft-dsvm" and cfg.image_reference.offer == "ubuntu-hpc"
    assert cfg.resource_tags(PROJECT, STACK) == {
        "costCenter": "ml-research",
        "project": PROJECT,
        "stack": STACK,
        "owner": "ml-platform@example.com",
    }


def test_sas_expiry_absolute_or_duration() -> None:
    now = datetime.now(UTC)
    in_a_week = (now + timedelta(days=7)).replace(microsecond=0)
    assert parse_config({**VALID_CONFIG, "sasExpiry": in_a_week.isoformat()}).sas_expiry == in_a_week
    rolled = parse_config(VALID_CONFIG).sas_expiry
    assert timedelta(days=29) < rolled - now <= timedelta(days=30, minutes=1)


def test_every_sku_has_gpus() -> None:
    assert all(sku.gpus_per_node > 0 for sku in GPU_SKUS.values())
    assert {"Standard_ND96isr_H100_v5", "Standard_ND96isr_H200_v5", "Standard_ND96asr_v4"} <= GPU_SKUS.keys()


def _set_pulumi_config(raw: dict[str, object]) -> None:
    pulumi.runtime.set_all_config(
        {f"{PROJECT}:{k}": json.dumps(v) if isinstance(v, dict) else str(v) for k, v in raw.items()}
    )


def test_load_config_reads_pulumi_config() -> None:
    pulumi.runtime.set_mocks(AzureMocks(), project=PROJECT, stack=STACK, preview=False)
    _set_pulumi_config(VALID_CONFIG)
    try:
        cfg = load_config()
    finally:
        pulumi.runtime.set_all_config({})
    assert cfg.node_count == 4 and cfg.tags == {"costCenter": "ml-research"}


def test_bad_config_declares_nothing() -> None:
    """Validation runs before the first resource: a failed `pulumi up` leaves nothing behind."""
    mocks = AzureMocks()
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=STACK, preview=False)
    _set_pulumi_config({**VALID_CONFIG, "nodeCount": "500"})
    try:
        with pytest.raises(ConfigError, match="nodeCount"):
            build_stack(load_config(), PROJECT, STACK)
    finally:
        pulumi.runtime.set_all_config({})
    assert mocks.resources == []


def test_dev_stack_file_passes_validation() -> None:
    stack_file = yaml.safe_load((Path(__file__).parents[2] / "Pulumi.dev.yaml").read_text())
    raw = {key.removeprefix(f"{PROJECT}:"): value for key, value in stack_file["config"].items()}
    assert all(key.startswith(f"{PROJECT}:") for key in stack_file["config"])
    cfg = parse_config(raw, PROJECT)
    assert cfg.gpu_sku in GPU_SKUS and cfg.allowed_ssh_cidr != "0.0.0.0/0"


def test_every_allowed_sku_has_nccl_settings() -> None:
    assert {sku: bool(nccl_env_for_sku(sku)) for sku in GPU_SKUS} == dict.fromkeys(GPU_SKUS, True)
