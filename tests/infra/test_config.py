"""Config validation: every bad value is refused with its key named, before any resource exists."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pulumi
import pytest
import yaml

from infra.azure_limits import (
    COMPUTER_NAME_PREFIX,
    CONTAINER_REGISTRY_NAME,
    DATA_DIR,
    KEY_VAULT_NAME,
    LINUX_COMPUTER_NAME,
    STORAGE_ACCOUNT_NAME,
    VM_SIZES,
    NameRule,
    VmSize,
)
from infra.config import (
    DERIVED_NAMES,
    MAX_TAGS,
    RESERVED_TAGS,
    ConfigError,
    StackConfig,
    load_config,
    parse_config,
    structured_keys,
)
from infra.skus import GPU_SKUS, GpuSku
from infra.stack import build_stack
from tests.infra.azure_mocks import AzureMocks
from tests.infra.conftest import KEPT_ACCOUNT_ID, PROJECT, STACK, VALID_CONFIG
from tests.infra.ssh_keys import ECDSA_P256, ED25519, RSA_1024, RSA_2048, blob, make_key, rsa_with, wire

REPO = Path(__file__).parents[2]
YESTERDAY = (datetime.now(UTC) - timedelta(days=1)).isoformat()
IN_TWO_HOURS = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
ED25519_WORD, ED25519_DATA, _ = ED25519.split()
ODD_2048_BIT_MODULUS = (1 << 2047) + 1

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
    ("headOsDiskSizeGb", "32"),  # below the HPC image's own disk
    ("headOsDiskSizeGb", "4096"),  # above Azure's largest OS disk
    ("headOsDiskSizeGb", "big"),
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
    *[("tags", {f"a{char}b": "x"}) for char in "<>%&\\?/"],  # characters Azure refuses in tag names
    ("allowOpenSsh", "maybe"),
    ("keyVaultPurgeProtection", "perhaps"),
    ("colour", "blue"),  # unknown key: a typo must not be silently ignored
    ("sshPublicKey", f'from="10.0.0.0/8" {ED25519}'),  # authorized_keys options are not a key
    ("sshPublicKey", "ssh-ed25519"),
    ("owner", "x" * 257),
]


# Values that passed before the issue "Reliability and security": each would have failed midway
# through `pulumi up`, or broken a promise the stack makes.
BAD_SSH_KEYS = [
    ED25519.replace("QLNQu9", "QL!Qu9"),  # corrupted base64
    ED25519.replace("AAAAC3NzaC1l", "AAAAD3NzaC1l"),  # corrupted length field
    make_key("ssh-ed25519", blob(RSA_2048)),  # type word and embedded type differ
    make_key("ssh-rsa", blob(ED25519)),
    f"{ED25519}\n{RSA_2048}",  # two keys in one value
    f"{ED25519} {RSA_2048}",
    f"{ED25519_WORD} {ED25519_DATA[:-8]}",  # truncated at a base64 group boundary
    f"{ED25519_WORD} {ED25519_DATA[:-3]}",  # truncated mid-group
    RSA_1024,  # Azure requires 2048 bits
    make_key("ssh-ed25519", wire(b"ssh-ed25519", bytes(31))),  # an ed25519 key is 32 bytes
    make_key("ssh-ed25519", blob(ED25519) + wire(b"extra")),  # trailing field
    make_key("ssh-ed25519", blob(ED25519) + b"\x00\x00"),  # trailing half a length field
    rsa_with(65536, ODD_2048_BIT_MODULUS),  # even exponent
    ECDSA_P256,  # Azure takes RSA and ed25519 keys only
]
BAD_NETWORKS = [
    ("allowedSshCidr", "0.0.0.0/1"),  # half the internet
    ("allowedSshCidr", "8.0.0.0/8"),
    ("allowedSshCidr", "100.0.0.0/15"),  # just wider than the /16 bound
    ("allowedSshCidr", "10.40.1.0/24"),  # inside the VNet
    ("allowedSshCidr", "10.40.0.0/16"),  # the VNet itself
    ("allowedSshCidr", "10.0.0.0/8"),  # contains the VNet
    ("allowedSshCidr", "127.0.0.1/32"),
    ("allowedSshCidr", "169.254.169.254/32"),  # link-local (the metadata service)
    ("allowedSshCidr", "224.0.0.0/4"),
    ("allowedSshCidr", "239.1.2.3/32"),
    ("allowedSshCidr", "240.0.0.0/4"),
    ("allowedSshCidr", "255.255.255.255/32"),
    ("allowedSshCidr", "0.0.0.0/8"),
    ("allowedSshCidr", "0.0.0.1/32"),
    ("vnetCidr", "127.0.0.0/16"),
    ("vnetCidr", "169.254.0.0/16"),
    ("vnetCidr", "0.0.0.0/16"),
]
BAD_TAGS = [
    {"owner": "someone-else"},  # would silently replace the stack's owner tag
    {"Project": "other"},
    {"STACK": "prod"},
    {"microsoftTeam": "x"},  # prefixes Azure reserves, in any case
    {"Azure.cost": "x"},
    {"WINDOWS-version": "x"},
    {"note": "x" * 257},
    {"costCenter": "a", "CostCenter": "b"},  # one tag to Azure
    {f"t{i}": "x" for i in range(MAX_TAGS - len(RESERVED_TAGS) + 1)},  # 51 with the stack's own
]
NEW_BAD_VALUES = [
    *[("sshPublicKey", value) for value in BAD_SSH_KEYS],
    *BAD_NETWORKS,
    *[("tags", value) for value in BAD_TAGS],
    ("sasExpiry", "PT1S"),
    ("sasExpiry", "PT1H"),
    ("sasExpiry", "PT23H"),
    ("sasExpiry", IN_TWO_HOURS),
    ("image", "microsoft-dsvm:ubuntu-hpc:2204 :latest"),
    ("image", "microsoft dsvm:ubuntu-hpc:2204:latest"),
    ("image", "microsoft-dsvm:ubuntu-hpc:2204:latest "),
    ("image", "microsoft-dsvm:ubuntu-hpc:22/04:latest"),
    ("image", "microsoft-dsvm:ubuntu-hpc:2204:v1"),
    ("adminUser", "admin1"),  # Azure's list, beyond the few names checked before
    ("adminUser", "john"),
    ("adminUser", "support_388945a0"),
    ("adminUser", "video"),
    ("adminUser", "user5"),
    ("adminUser", "a"),
    ("owner", "   "),
    ("owner", "\t"),
    ("location", "westeurope2"),
    ("location", "mars"),
    ("location", "global"),
    ("nfsVmSize", "Standard_X99_v9"),  # sizes whose limits are unknown
    ("nfsVmSize", "Standard_D16_v5"),  # no premium storage
    ("jumpboxVmSize", "Standard_A2_v2"),  # no encryption at host, no premium storage
    ("headVmSize", "Standard_X99_v9"),
    ("autostopMinutes", "-1"),
    ("autostopMinutes", "5"),  # shorter than a GPU node takes to come back
    ("autostopMinutes", "1441"),
    ("autostopMinutes", "thirty"),
    ("autostopMinutes", "1.5"),
    ("spotNodeCount", "-1"),
    ("spotNodeCount", "101"),  # one placement group
    ("spotEvictionPolicy", "Stop"),
    ("spotEvictionPolicy", "deallocate"),
    ("spotEvictionPolicy", "Delete"),  # its nodes would stay DOWN for good after an eviction
    ("spotMaxPrice", "0"),
    ("spotMaxPrice", "-2"),
    ("spotMaxPrice", "18.123456"),  # Azure takes 5 decimals
    ("defaultJobTime", "0"),  # Slurm's "no limit" for --time: every job ends
    ("defaultJobTime", "INFINITE"),
    ("defaultJobTime", "UNLIMITED"),
    ("defaultJobTime", "24h"),
    ("defaultJobTime", "1:2:3:4"),
    ("defaultJobTime", "-1"),
    ("maxJobTime", "forever"),
    ("maxJobTime", "0"),
    ("maxJobTime", "7 days"),
    ("keptResultsAccount", "hvdsa1a2b3c4d"),  # a name, not an id
    ("keptResultsAccount", "/subscriptions/x/resourceGroups/g/providers/Microsoft.Storage/storageAccounts/hvdsa1"),
    ("keptResultsAccount", f"{KEPT_ACCOUNT_ID[:-6]}HVDSA1"),  # account names are lower case
    ("keptResultsAccount", KEPT_ACCOUNT_ID.replace("Microsoft.Storage", "Microsoft.KeyVault")),
    ("keptResultsAccount", f"{KEPT_ACCOUNT_ID}/blobServices/default/containers/results"),
    ("keptResultsApproval", "Manual"),
    ("keptResultsApproval", "later"),
]


def test_a_bad_kept_results_account_is_one_error_line() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, "keptResultsAccount": "hvdsa1a2b3c4d"}, PROJECT)
    (line,) = str(raised.value).splitlines()[1:]
    assert line.startswith(
        f"  {PROJECT}:keptResultsAccount: got 'hvdsa1a2b3c4d'; must be a storage account's resource id"
    )


def _bad_id(key: str, value: object) -> str:
    # the moments of this run by name: an id must be the same in every pytest-xdist worker (make test)
    names = {YESTERDAY: "YESTERDAY", IN_TWO_HOURS: "IN_TWO_HOURS"}
    shown = names[value] if isinstance(value, str) and value in names else repr(value)
    return f"{key}={shown}"[:60]


@pytest.mark.parametrize(
    ("key", "value"), BAD_VALUES + NEW_BAD_VALUES, ids=[_bad_id(k, v) for k, v in BAD_VALUES + NEW_BAD_VALUES]
)
def test_bad_value_names_key_and_value(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, key: value}, PROJECT)
    lines = str(raised.value).splitlines()[1:]
    assert [line for line in lines if line.startswith(f"  {PROJECT}:{key}: ")], lines
    assert repr(value)[:60] in str(raised.value)


BAD_COMBINATIONS = [
    ({"keptResultsApproval": "manual"}, "keptResultsApproval", "without keptResultsAccount"),
    ({"nfsVmSize": "Standard_D2s_v5", "nfsDiskCount": "8"}, "nfsDiskCount", "holds at most 4 data disks"),
    ({"nfsVmSize": "Standard_B2s", "nfsDiskCount": "5"}, "nfsDiskCount", "holds at most 4 data disks"),
    ({"nfsVmSize": "Standard_L8s_v3", "nfsDiskCount": "17"}, "nfsDiskCount", "holds at most 16 data disks"),
    ({"vnetCidr": "192.168.0.0/16", "allowedSshCidr": "192.168.7.0/24"}, "allowedSshCidr", "overlaps vnetCidr"),
    ({"allowedSshCidr": "0.0.0.0/1", "allowOpenSsh": "false"}, "allowedSshCidr", "2,147,483,648 public addresses"),
    (
        {"defaultJobTime": "24:00:00", "maxJobTime": "4:00:00"},  # the default's default above a lowered max
        "defaultJobTime",
        "is longer than maxJobTime 4:00:00, the longest a job may run; lower defaultJobTime or raise maxJobTime",
    ),
    ({"defaultJobTime": "2-00:00:01", "maxJobTime": "2-00:00:00"}, "defaultJobTime", "longer than maxJobTime"),
    (  # the longest prefix the pattern admits, with Spot nodes: `<prefix>-spot-` is 16 characters
        {"namePrefix": "abcdefghij", "spotNodeCount": "1"},
        "namePrefix",
        "makes the Spot nodes' computer name prefix 'abcdefghij-spot-' (16 characters; Azure allows 1-15 "
        "lower-case letters, digits and hyphens); give a namePrefix of at most 9 characters while spotNodeCount "
        "is above 0",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "reason"), BAD_COMBINATIONS)
def test_rules_across_keys_name_the_key_and_value(overrides: dict[str, str], key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, **overrides}, PROJECT)
    assert f"  {PROJECT}:{key}: got {overrides[key]!r}; " in str(raised.value)
    assert reason in str(raised.value)


@pytest.mark.parametrize(
    "accepted",
    [
        {"allowedSshCidr": "0.0.0.0/1", "allowOpenSsh": "true"},  # consented: the bound is about consent
        {"allowedSshCidr": "198.51.0.0/16"},  # a public /16 is still the operator's range
        {"allowedSshCidr": "172.16.0.0/12"},  # a wide private range outside the VNet (a VPN)
        {"sshPublicKey": RSA_2048},
        {"sshPublicKey": f"  {ED25519_WORD} {ED25519_DATA} a comment with spaces \n"},
        {"sasExpiry": "P1D"},
        {"tags": {f"t{i}": "x" * 256 for i in range(MAX_TAGS - len(RESERVED_TAGS))}},
        {"image": "microsoft-dsvm:ubuntu-hpc:2204:22.04.2024102301"},
        {"location": "swedencentral", "nfsVmSize": "Standard_L8s_v3", "nfsDiskCount": "16"},
        {"jumpboxVmSize": "Standard_B2s_v2", "owner": "  ml-platform@example.com  "},
        {"spotNodeCount": "100", "spotEvictionPolicy": "Deallocate", "spotMaxPrice": "18.16954"},
        {"namePrefix": "abcdefghij"},  # the longest prefix, without Spot nodes
        {"namePrefix": "abcdefghi", "spotNodeCount": "1"},  # the longest with them
        {"namePrefix": "ab"},  # the shortest: the registry's name still has its 5 characters
        {"spotNodeCount": "0", "spotMaxPrice": "-1"},
        {"defaultJobTime": "2-00:00:00", "maxJobTime": "2-00:00:00"},  # the default may be the max
        {"defaultJobTime": "90", "maxJobTime": "1-12"},
        {"keptResultsAccount": KEPT_ACCOUNT_ID},
        {"keptResultsAccount": KEPT_ACCOUNT_ID.lower()},  # Azure reads an id's fixed segments in any case
        {"keptResultsAccount": KEPT_ACCOUNT_ID, "keptResultsApproval": "manual"},
        {"keptResultsAccount": KEPT_ACCOUNT_ID, "keptResultsApproval": "auto"},
    ],
)
def test_valid_edges_are_accepted(accepted: dict[str, object]) -> None:
    parse_config({**VALID_CONFIG, **accepted}, PROJECT)


def test_ssh_key_and_owner_are_stored_stripped() -> None:
    cfg = parse_config({**VALID_CONFIG, "sshPublicKey": f" {ED25519}\n", "owner": " me@example.com "})
    assert cfg.ssh_public_key == ED25519 and cfg.owner == "me@example.com"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (RSA_1024, "is a 1024-bit RSA key; Azure requires at least 2048 bits"),
        (make_key("ssh-ed25519", blob(RSA_2048)), "says ssh-ed25519 but its key data holds a 'ssh-rsa' key"),
        (f"{ED25519} {RSA_2048}", "holds more than one key"),
        (f"{ED25519_WORD} {ED25519_DATA[:-8]}", "cut short"),
        (ECDSA_P256, "of type ssh-rsa or ssh-ed25519; Azure refuses other types"),
    ],
)
def test_ssh_key_errors_say_what_is_wrong(value: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)):
        parse_config({**VALID_CONFIG, "sshPublicKey": value}, PROJECT)


def test_long_values_are_shortened_in_errors() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, "tags": {f"t{i}": "x" for i in range(60)}}, PROJECT)
    line = next(line for line in str(raised.value).splitlines() if ":tags: got" in line)
    assert "characters)" in line and "60 tags plus the stack's 3 exceed Azure's 50" in line
    assert len(line) < 300


def test_region_typo_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'eastus'"):
        parse_config({**VALID_CONFIG, "location": "East US"}, PROJECT)


def test_unknown_size_error_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="Standard_D16s_v5") as raised:
        parse_config({**VALID_CONFIG, "nfsVmSize": "Standard_X99_v9"}, PROJECT)
    assert "infra/data/vm_sizes.json" in str(raised.value)


def test_size_without_encryption_at_host_needs_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        VM_SIZES,
        "Standard_Legacy_v1",
        VmSize(max_data_disks=8, encryption_at_host=False, vcpus=8, quota_family="legacyFamily"),
    )
    legacy = GpuSku(
        8, "V100", 40, 672, encryption_at_host=False, nccl_env={"NCCL_DEBUG": "WARN"}, quota_family="legacyFamily"
    )
    monkeypatch.setitem(GPU_SKUS, "Standard_NDlegacy", legacy)
    raw = {
        **VALID_CONFIG,
        "jumpboxVmSize": "Standard_Legacy_v1",
        "headVmSize": "Standard_Legacy_v1",
        "gpuSku": "Standard_NDlegacy",
    }
    with pytest.raises(ConfigError) as raised:
        parse_config(raw, PROJECT)
    message = str(raised.value)
    for key, size in (
        ("jumpboxVmSize", "Standard_Legacy_v1"),
        ("headVmSize", "Standard_Legacy_v1"),
        ("gpuSku", "Standard_NDlegacy"),
    ):
        assert f"{PROJECT}:{key}: got {size!r}; does not support encryption at host" in message
    assert "nfsVmSize" not in message
    assert parse_config({**raw, "encryptionAtHost": "false"}).encryption_at_host is False


def test_encryption_at_host_is_on_by_default() -> None:
    assert parse_config(VALID_CONFIG).encryption_at_host is True


def test_key_vault_purge_protection_is_on_unless_turned_off() -> None:
    assert parse_config(VALID_CONFIG).key_vault_purge_protection is True
    assert parse_config({**VALID_CONFIG, "keyVaultPurgeProtection": "false"}).key_vault_purge_protection is False


def test_default_sizes_are_known_and_support_encryption_at_host() -> None:
    cfg = parse_config(VALID_CONFIG)
    for size in (cfg.jumpbox_vm_size, cfg.head_vm_size, cfg.nfs_vm_size):
        assert VM_SIZES[size].encryption_at_host
    assert all(sku.encryption_at_host for sku in GPU_SKUS.values())


@pytest.mark.parametrize("name", ["azure_regions.json", "reserved_admin_users.json", "vm_sizes.json"])
def test_data_files_name_their_source_and_date(name: str) -> None:
    document = json.loads((DATA_DIR / name).read_text())
    assert document["retrieved"] == "2026-11-22"
    sources = [document.get("source"), *document.get("sources", [])]
    sources += [family["page"] for family in document.get("families", {}).values()]
    assert [url for url in sources if url] and all(url.startswith("https://") for url in sources if url)


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
    assert cfg.head_private_ip == "10.40.63.254"  # the cluster subnet's last usable address
    assert cfg.autostop_minutes == 30 and cfg.head_vm_size == "Standard_D4s_v5"
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
        {f"{PROJECT}:{k}": json.dumps(v) if isinstance(v, dict | list) else str(v) for k, v in raw.items()}
    )


def test_load_config_reads_pulumi_config() -> None:
    pulumi.runtime.set_mocks(AzureMocks(), project=PROJECT, stack=STACK, preview=False)
    _set_pulumi_config(VALID_CONFIG)
    try:
        cfg = load_config()
    finally:
        pulumi.runtime.set_all_config({})
    assert cfg.node_count == 4 and cfg.tags == {"costCenter": "ml-research"}


def test_load_config_reads_the_people_and_the_accounts_limits_as_the_stack_file_gives_them() -> None:
    """A YAML list or map in the stack file reaches the program as JSON text (Pulumi's config.get)."""
    pulumi.runtime.set_mocks(AzureMocks(), project=PROJECT, stack=STACK, preview=False)
    person = {"name": "alice", "sshPublicKey": ED25519, "account": "vision", "limits": {"maxGpus": 8}}
    _set_pulumi_config({**VALID_CONFIG, "users": [person], "accounts": {"vision": {"gpuHours": 500}}})
    try:
        cfg = load_config()
    finally:
        pulumi.runtime.set_all_config({})
    assert [(user.name, user.limits.max_gpus) for user in cfg.users] == [("alice", 8)]
    assert cfg.accounts["vision"].gpu_hours == 500
    assert structured_keys() == {"tags", "users", "accounts"}


@pytest.mark.parametrize(("key", "value"), [("nodeCount", "500"), ("headOsDiskSizeGb", "30")])
def test_bad_config_declares_nothing(key: str, value: str) -> None:
    """Validation runs before the first resource: a failed `pulumi up` leaves nothing behind."""
    mocks = AzureMocks()
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=STACK, preview=False)
    _set_pulumi_config({**VALID_CONFIG, key: value})
    try:
        with pytest.raises(ConfigError, match=key):
            build_stack(load_config(), PROJECT, STACK)
    finally:
        pulumi.runtime.set_all_config({})
    assert mocks.resources == []


def dev_stack() -> StackConfig:
    stack_file = yaml.safe_load((REPO / "Pulumi.dev.yaml").read_text())
    assert all(key.startswith(f"{PROJECT}:") for key in stack_file["config"])
    return parse_config(
        {key.removeprefix(f"{PROJECT}:"): value for key, value in stack_file["config"].items()}, PROJECT
    )


def test_dev_stack_file_passes_validation() -> None:
    cfg = dev_stack()
    assert cfg.gpu_sku in GPU_SKUS and cfg.allowed_ssh_cidr != "0.0.0.0/0"
    assert (cfg.default_job_time, cfg.max_job_time) == ("24:00:00", "7-00:00:00")  # quoted: not YAML's base 60


def test_the_documented_gpu_quota_is_what_the_dev_stack_needs() -> None:
    """docs/deploy.md and the README give the default stack's GPU quota as nodeCount x its size's vCPUs,
    and deploy.md has a row for every size the config accepts, with the quota family `dtrain doctor`
    checks: a new default or size changes them too."""
    cfg = dev_stack()
    need = cfg.node_count * cfg.sku.vcpus
    deploy = (REPO / "docs" / "deploy.md").read_text()
    assert f"{cfg.sku.vcpus} per node: **{need}** for {cfg.node_count} x {cfg.gpu_sku}" in deploy
    rows = {
        name: re.search(rf"^\| `{name}`[^|]*\| `(\w+)` \| (\d+) \| (\d+) \|$", deploy, re.MULTILINE)
        for name in GPU_SKUS
    }
    assert {name: row and (row[1], int(row[2]), int(row[3])) for name, row in rows.items()} == {
        name: (sku.quota_family, sku.vcpus, sku.vcpus * cfg.node_count) for name, sku in GPU_SKUS.items()
    }
    assert f"{need} for the default {cfg.node_count} nodes" in (REPO / "README.md").read_text()


def test_every_allowed_sku_has_nccl_settings_and_what_slurm_needs() -> None:
    for sku in GPU_SKUS.values():
        assert sku.nccl_env["NCCL_TOPO_FILE"].startswith("/opt/microsoft/")
        assert sku.vcpus > 0 and sku.gpus_per_node > 0
        # Slurm drains a node that registers with less memory than configured: leave room.
        assert sku.slurm_real_memory_mb < sku.memory_gib * 1024 * 0.95


@pytest.mark.parametrize(("minutes", "expected"), [("0", 0), ("10", 10), ("1440", 1440)])
def test_autostop_minutes_accepts_never_and_its_range(minutes: str, expected: int) -> None:
    assert parse_config({**VALID_CONFIG, "autostopMinutes": minutes}).autostop_minutes == expected


def test_autostop_error_says_what_is_allowed() -> None:
    with pytest.raises(
        ConfigError, match=r"autostopMinutes: got '5'; must be 0 \(never stop idle nodes\) or 10 to 1440"
    ):
        parse_config({**VALID_CONFIG, "autostopMinutes": "5"}, PROJECT)


def test_job_times_default_to_a_day_and_no_cap() -> None:
    cfg = parse_config(VALID_CONFIG)
    assert (cfg.default_job_time, cfg.max_job_time) == ("24:00:00", "INFINITE")


@pytest.mark.parametrize(
    ("given", "kept"), [("UNLIMITED", "INFINITE"), ("unlimited", "INFINITE"), (" 7-00:00:00 ", "7-00:00:00")]
)
def test_max_job_time_is_kept_as_slurm_conf_writes_it(given: str, kept: str) -> None:
    cfg = parse_config({**VALID_CONFIG, "defaultJobTime": " 4:00:00", "maxJobTime": given})
    assert (cfg.default_job_time, cfg.max_job_time) == ("4:00:00", kept)


def test_job_time_errors_say_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, "defaultJobTime": "INFINITE", "maxJobTime": "forever"}, PROJECT)
    text = str(raised.value)
    assert f"{PROJECT}:defaultJobTime: got 'INFINITE'; must be in Slurm's --time syntax, e.g. 90 (minutes)" in text
    assert "a job that names no limit ends too" in text
    assert f"{PROJECT}:maxJobTime: got 'forever'; must be in Slurm's --time syntax" in text
    assert "or INFINITE (or UNLIMITED) for no cap" in text


def test_spot_delete_eviction_is_refused_with_the_reason() -> None:
    """A deleted instance never comes back under its Slurm name: the node would be DOWN for good."""
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, "spotNodeCount": "2", "spotEvictionPolicy": "Delete"}, PROJECT)
    (line,) = str(raised.value).splitlines()[1:]
    assert line.startswith(f"  {PROJECT}:spotEvictionPolicy: got 'Delete'; is not supported: ")
    assert "stay DOWN for good; use Deallocate" in line
    assert parse_config({**VALID_CONFIG, "spotEvictionPolicy": "Deallocate"}).spot_eviction_policy == "Deallocate"


def test_a_spot_prefix_too_long_for_azure_declares_nothing() -> None:
    """Issue 29: the 15-character check fired inside an apply, after both scale sets existed."""
    mocks = AzureMocks()
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=STACK, preview=False)
    _set_pulumi_config({**VALID_CONFIG, "namePrefix": "abcdefghij", "spotNodeCount": "2"})
    try:
        with pytest.raises(ConfigError) as raised:
            build_stack(load_config(), PROJECT, STACK)
    finally:
        pulumi.runtime.set_all_config({})
    assert mocks.resources == []
    (line,) = str(raised.value).splitlines()[1:]  # one line, naming the key and the limit
    assert line.startswith(f"  {PROJECT}:namePrefix: got 'abcdefghij'; ") and "Azure allows 1-15" in line


@pytest.mark.parametrize("spot", ["0", "1"])
@pytest.mark.parametrize("length", range(2, 11))
def test_every_derived_name_fits_azure_or_the_prefix_is_refused(length: int, spot: str) -> None:
    prefix = "abcdefghij"[:length]
    broken = [
        (what, name)
        for what, make, rule, needs_spot in DERIVED_NAMES
        if (spot == "1" or not needs_spot) and not rule.admits(name := make(prefix))
    ]
    raw = {**VALID_CONFIG, "namePrefix": prefix, "spotNodeCount": spot}
    if not broken:
        assert set(parse_config(raw).derived_names.values()) == {
            make(prefix) for _, make, _, needs_spot in DERIVED_NAMES if spot == "1" or not needs_spot
        }
        return
    with pytest.raises(ConfigError) as raised:
        parse_config(raw, PROJECT)
    for what, name in broken:
        assert f"{what} {name!r} ({len(name)} characters; Azure allows" in str(raised.value)


@pytest.mark.parametrize(
    ("rule", "good", "bad"),
    [
        (STORAGE_ACCOUNT_NAME, ["abc", "a" * 24], ["ab", "a" * 25, "has-hyphen", "Upper"]),
        (KEY_VAULT_NAME, ["abc", "a-b" * 8], ["ab", "a" * 25, "1starts-with-digit", "ends-", "double--hyphen"]),
        (CONTAINER_REGISTRY_NAME, ["abcde", "A" * 50], ["abcd", "a" * 51, "has-hyphen"]),
        (COMPUTER_NAME_PREFIX, ["a", "a" * 14 + "-"], ["", "a" * 16, "Upper-"]),
        (LINUX_COMPUTER_NAME, ["a", "a1-" * 21 + "a"], ["", "a" * 65, "123", "under_score"]),
    ],
)
def test_name_rules_admit_and_refuse_what_azure_does(rule: NameRule, good: list[str], bad: list[str]) -> None:
    assert all(rule.admits(name) for name in good)
    assert [name for name in bad if rule.admits(name)] == []


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("21.08.5", "Slurm 21.08 is not one this deployment renders its configuration for (23.11, "),
        ("26.05.1", "Slurm 26.05 is not one"),  # newer than the key tables the renderer is checked against
        ("25.11", "is not a Slurm version such as '25.11.5'"),
        ("latest", "is not a Slurm version such as '25.11.5'"),
        ("25.11.5-1; reboot", "is not a Slurm version"),
    ],
)
def test_slurm_version_is_checked_at_config_time(value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**VALID_CONFIG, "slurmVersion": value}, PROJECT)
    assert f"  {PROJECT}:slurmVersion: got {value!r}; " in str(raised.value)
    assert reason in str(raised.value)


def test_slurm_version_defaults_to_what_azures_stacks_install() -> None:
    assert parse_config(VALID_CONFIG, PROJECT).slurm_version == "25.11.5"
    assert parse_config({**VALID_CONFIG, "slurmVersion": "24.11.6-2"}, PROJECT).slurm_version == "24.11.6-2"
