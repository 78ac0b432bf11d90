"""sharedStorage lustre: Azure Managed Lustre in place of the NFS server, checked at config time and under
Pulumi's mocks (the file system, its subnet and rules, the import's roles and storage settings, what the
hosts' custom data mounts), and the NFS default left as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.azure_limits import AMLFS_SKUS, amlfs_subnet_prefix
from infra.config import ConfigError, parse_config
from infra.contract import LUSTRE_CLIENT_PORTS, LUSTRE_PORT
from infra.identity import STORAGE_BLOB_DATA_CONTRIBUTOR
from infra.lustre import STORAGE_ACCOUNT_CONTRIBUTOR
from infra.network import DENY_ALL_PRIORITY
from tests.infra.azure_mocks import LUSTRE_MGS
from tests.infra.conftest import LUSTRE_CONFIG, VALID_CONFIG, Deployment, deploy
from tests.infra.sandbox import Sandbox, shell_value, systemd_verify, with_value
from tests.infra.test_cloud_init import runnable
from tests.infra.test_stack import by_name, head_document, node_document, one

HSM_PRINCIPAL = "00000000-0000-0000-0000-0000000000ee"
IMPORT_CONFIG = {**LUSTRE_CONFIG, "lustreImportData": "true", "lustreHsmPrincipalId": HSM_PRINCIPAL}
LUSTRE_SUBNET = "10.40.192.0/18"  # the last quarter of the default vnetCidr 10.40.0.0/16
CLUSTER_SUBNET = "10.40.0.0/18"
MOUNT_SOURCE = f"{LUSTRE_MGS}@tcp:/lustrefs"


@pytest.fixture(scope="module")
def lustre() -> Deployment:
    return deploy(LUSTRE_CONFIG)


@pytest.fixture(scope="module")
def imported() -> Deployment:
    return deploy(IMPORT_CONFIG)


def faults(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_config(raw)
    return str(refused.value)


# --- refused at config time, before any resource is declared -------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ({"lustreTier": "100"}, "lustreTier", "40, 125, 250, 500"),
        ({"lustreCapacityTib": "20"}, "lustreCapacityTib", "16 to 128 TiB in steps of 16"),
        ({"lustreCapacityTib": "8"}, "lustreCapacityTib", "16 to 128 TiB"),
        ({"lustreCapacityTib": "144"}, "lustreCapacityTib", "16 to 128 TiB"),
        ({"lustreTier": "40", "lustreCapacityTib": "16"}, "lustreCapacityTib", "48 to 768 TiB in steps of 48"),
        ({"lustreTier": "500", "lustreCapacityTib": "6"}, "lustreCapacityTib", "4 to 128 TiB in steps of 4"),
        ({"lustreCapacityTib": None}, "lustreCapacityTib", "required with sharedStorage lustre"),
        ({"lustreZone": "4"}, "lustreZone", "'1', '2', '3' or 'none'"),
        ({"lustreMaintenanceTime": "25:00"}, "lustreMaintenanceTime", "pattern"),
        ({"lustreMaintenanceDay": "Funday"}, "lustreMaintenanceDay", "Sunday"),
        ({"lustreImportData": "true"}, "lustreHsmPrincipalId", "HPC Cache Resource Provider"),
        ({"lustreHsmPrincipalId": HSM_PRINCIPAL}, "lustreHsmPrincipalId", "does nothing without lustreImportData"),
        ({"lustreImportData": "true", "lustreHsmPrincipalId": "hpc-cache"}, "lustreHsmPrincipalId", "GUID"),
        ({"nfsDiskCount": "4"}, "nfsDiskCount", "applies to sharedStorage nfs only"),
        ({"nfsVmSize": "Standard_D16s_v5"}, "nfsVmSize", "applies to sharedStorage nfs only"),
        ({"sharedStorage": "beegfs"}, "sharedStorage", "'nfs' or 'lustre'"),
    ],
)
def test_bad_lustre_settings_are_refused_with_the_key_and_the_rule(
    overrides: dict[str, str | None], key: str, words: str
) -> None:
    raw = {k: v for k, v in {**LUSTRE_CONFIG, **overrides}.items() if v is not None}
    message = faults(raw)
    assert f"azure-horovod:{key}" not in message  # parse_config names keys without the namespace
    (line,) = [line for line in message.splitlines() if line.strip().startswith(f"{key}:")]
    assert words in line, message


def test_a_capacity_too_large_for_the_subnet_is_refused_with_the_vnet_it_needs() -> None:
    # a /22 VNet leaves the file system a /24 quarter: Azure sizes 200-400 TiB at /23
    message = faults({**LUSTRE_CONFIG, "vnetCidr": "10.40.0.0/22", "lustreTier": "40", "lustreCapacityTib": "240"})
    assert "needs a /23 subnet or larger" in message and "10.40.3.0/24" in message
    assert "vnetCidr of /21 or larger" in message
    # the same VNet holds a file system Azure sizes at /24
    assert parse_config({**LUSTRE_CONFIG, "vnetCidr": "10.40.0.0/22", "lustreCapacityTib": "128"}).subnets == {
        "cluster": "10.40.0.0/24",
        "lustre": "10.40.3.0/24",
        "jumpbox": "10.40.2.0/24",
    }


@pytest.mark.parametrize("key", ["lustreTier", "lustreCapacityTib", "lustreImportData", "lustreZone"])
def test_lustre_keys_are_refused_on_an_nfs_stack(key: str) -> None:
    value = {"lustreTier": "125", "lustreCapacityTib": "16", "lustreImportData": "false", "lustreZone": "1"}[key]
    assert f"{key}: got {value!r}; applies to sharedStorage lustre only" in faults({**VALID_CONFIG, key: value})


def test_every_tier_takes_its_smallest_and_largest_size_and_subnets_follow_azures_table() -> None:
    for tier, sku in AMLFS_SKUS.items():
        for capacity in (sku.min_tib, sku.max_tib):
            cfg = parse_config({**LUSTRE_CONFIG, "lustreTier": str(tier), "lustreCapacityTib": str(capacity)})
            assert cfg.lustre_sku.name == f"AMLFS-Durable-Premium-{tier}"
    assert [amlfs_subnet_prefix(tib) for tib in (4, 16, 20, 40, 44, 92, 96, 196, 200, 400, 768)] == [
        27, 27, 26, 26, 25, 25, 24, 24, 23, 23, 22,
    ]  # fmt: skip


# --- the file system, its subnet and rules, and no NFS server -------------------------------------


def test_lustre_declares_the_file_system_in_its_own_subnet_and_no_nfs_server(lustre: Deployment) -> None:
    fs = one(lustre, ":AmlFilesystem").inputs
    subnet = by_name(lustre, ":Subnet", "-lustre")
    assert (fs["sku"], fs["storageCapacityTiB"], fs["zones"]) == ({"name": "AMLFS-Durable-Premium-125"}, 16, ["1"])
    assert fs["filesystemSubnet"] == subnet.id and subnet.inputs["addressPrefix"] == LUSTRE_SUBNET
    assert fs["maintenanceWindow"] == {"dayOfWeek": "Sunday", "timeOfDayUTC": "02:00"}
    assert "hsm" not in fs  # no import unless asked
    assert fs["rootSquashSettings"] == {"mode": "None"}  # root writes there, as on the NFS export
    # no NFS server: its VM, NIC, disks and subnet are gone; the head node and jumpbox remain
    vms = sorted(vm.name for vm in lustre.mocks.of_type(":VirtualMachine"))
    assert vms == ["hvd-head-vm", "hvd-jumpbox-vm"]
    subnets = {r.name.removeprefix("hvd-net-") for r in lustre.mocks.of_type(":Subnet")}
    assert subnets == {"cluster", "lustre", "jumpbox"}
    assert not [r for r in lustre.mocks.resources if r.type.endswith("NfsServer")]


def test_lustre_subnet_admits_only_the_clients_on_lnets_port_and_its_own_servers(lustre: Deployment) -> None:
    rules = by_name(lustre, ":NetworkSecurityGroup", "-lustre-nsg").inputs["securityRules"]
    allows = [
        (r["name"], r["sourceAddressPrefix"], r["sourcePortRange"], r["destinationPortRanges"], r["protocol"])
        for r in rules
        if r["access"] == "Allow"
    ]
    assert allows == [
        ("AllowLustreWithinSubnet", LUSTRE_SUBNET, "*", ["0-65535"], "*"),
        ("AllowLustreFromCluster", CLUSTER_SUBNET, LUSTRE_CLIENT_PORTS, [str(LUSTRE_PORT)], "Tcp"),
    ]
    assert [(r["name"], r["priority"]) for r in rules if r["access"] == "Deny"] == [
        ("DenyAllInbound", DENY_ALL_PRIORITY)
    ]
    # no SSH to it, and the cluster's own rules are the NFS stack's
    cluster = by_name(lustre, ":NetworkSecurityGroup", "-cluster-nsg").inputs["securityRules"]
    assert [r["name"] for r in cluster] == [
        "AllowSlurmInCluster", "AllowClusterInternal", "AllowSshFromJumpbox", "DenyAllInbound",
    ]  # fmt: skip


def test_without_the_import_storage_keeps_its_settings_and_blob_stays_closed_to_lustre(lustre: Deployment) -> None:
    account = one(lustre, ":StorageAccount").inputs
    assert "allowSharedKeyAccess" not in account
    subnets = {r.name: r.id for r in lustre.mocks.of_type(":Subnet")}
    rules = account["networkRuleSet"]["virtualNetworkRules"]
    # the head node (cluster subnet) copies the datasets in: the file system's subnet needs no access
    assert [r["virtualNetworkResourceId"] for r in rules] == [subnets["hvd-net-cluster"]]
    containers = {r.inputs["containerName"] for r in lustre.mocks.of_type(":BlobContainer")}
    assert containers == {"data", "results"}
    assert not [r for r in lustre.mocks.of_type(":RoleAssignment") if r.name.startswith("hvd-lustre-import-")]


def test_the_import_grants_azures_two_roles_before_the_file_system_and_opens_key_access(imported: Deployment) -> None:
    account = one(imported, ":StorageAccount")
    assignments = imported.mocks.of_type(":RoleAssignment")
    grants = {r.name: r.inputs for r in assignments if r.name.startswith("hvd-lustre-import-")}
    assert {g["roleDefinitionId"].rsplit("/", 1)[-1] for g in grants.values()} == {
        STORAGE_ACCOUNT_CONTRIBUTOR,
        STORAGE_BLOB_DATA_CONTRIBUTOR,
    }
    for grant in grants.values():
        assert (grant["principalId"], grant["principalType"], grant["scope"]) == (
            HSM_PRINCIPAL,
            "ServicePrincipal",
            account.id,
        )
    fs = one(imported, ":AmlFilesystem")
    assert set(grants) <= imported.mocks.waits_for(fs.name)  # Azure checks the access only as it creates
    containers = {r.inputs["containerName"]: r for r in imported.mocks.of_type(":BlobContainer")}
    assert set(containers) == {"data", "results", "lustre-import-logs"}
    settings = fs.inputs["hsm"]["settings"]
    assert (settings["container"], settings["loggingContainer"]) == (
        containers["data"].id,
        containers["lustre-import-logs"].id,
    )
    assert settings["importPrefixesInitial"] == ["/"]  # the whole container: every dataset staged there
    # what it costs: the account's shared keys on, and the file system's subnet through its firewall
    assert account.inputs["allowSharedKeyAccess"] is True
    subnets = {r.name: r.id for r in imported.mocks.of_type(":Subnet")}
    assert {r["virtualNetworkResourceId"] for r in account.inputs["networkRuleSet"]["virtualNetworkRules"]} == {
        subnets["hvd-net-cluster"],
        subnets["hvd-net-lustre"],
    }
    services = [e["service"] for e in by_name(imported, ":Subnet", "-lustre").inputs["serviceEndpoints"]]
    assert services == ["Microsoft.Storage"]


def test_outputs_name_the_file_system_and_where_the_datasets_are(lustre: Deployment, imported: Deployment) -> None:
    out = {key: value.value for key, value in lustre.outputs.items()}
    assert out["shared_storage"] == "lustre" and out["lustre_mgs_address"] == LUSTRE_MGS
    assert out["nfs_private_ip"] is None and out["nfs_export_path"] is None
    assert out["data_path"] == "/shared/data"
    # imported at the file system's root: the container's <dataset>/ is /shared/<dataset>
    assert imported.outputs["data_path"].value == "/shared"


def test_the_nfs_default_declares_no_lustre_and_keeps_the_storage_account_as_it_was(deployment: Deployment) -> None:
    assert not deployment.mocks.of_type(":AmlFilesystem")
    assert "allowSharedKeyAccess" not in one(deployment, ":StorageAccount").inputs
    out = {key: value.value for key, value in deployment.outputs.items()}
    assert (out["shared_storage"], out["lustre_mgs_address"]) == ("nfs", None)
    node = files(node_document(deployment))
    assert "/usr/local/sbin/nfs-mount" in node
    assert not {"/usr/local/sbin/lustre-mount", "/usr/local/sbin/shared-release"} & set(node)


# --- what the hosts' custom data mounts -------------------------------------------------------------


def files(document: str) -> dict[str, str]:
    return {entry["path"]: entry["content"] for entry in yaml.safe_load(document)["write_files"]}


def test_nodes_mount_lustre_with_the_images_client_as_a_boot_step(lustre: Deployment) -> None:
    node = files(node_document(lustre))
    mount = node["/usr/local/sbin/lustre-mount"]
    assert shell_value(mount, "SOURCE") == MOUNT_SOURCE and shell_value(mount, "MOUNT_PATH") == "/shared"
    assert shell_value(mount, "FS_TYPE") == "lustre"
    assert {"noatime", "flock", "_netdev", "nofail"} <= set(str(shell_value(mount, "MOUNT_OPTIONS")).split(","))
    assert "command -v mount.lustre" in mount  # the image's client, nothing installed
    assert "/usr/local/sbin/nfs-mount" not in node
    setup = node["/usr/local/sbin/node-setup"]
    assert shell_value(setup, "MOUNT_STEP") == "lustre-mount"
    # the release the agent runs before the node goes, with the mount it releases
    assert node["/usr/local/sbin/shared-release"].startswith("#!/usr/bin/python3")
    drop_in = node["/etc/systemd/system/spot-agent.service.d/shared-release.conf"]
    assert "--release-program /usr/local/sbin/shared-release --release-mount /shared" in drop_in


def test_the_spot_agents_drop_in_passes_systemd_analyze_verify(lustre: Deployment, tmp_path: Path) -> None:
    node = files(node_document(lustre))
    (tmp_path / "spot-agent.service").write_text(runnable(node["/etc/systemd/system/spot-agent.service"]))
    drop_in = tmp_path / "spot-agent.service.d" / "shared-release.conf"
    drop_in.parent.mkdir()
    drop_in.write_text(runnable(node["/etc/systemd/system/spot-agent.service.d/shared-release.conf"]))
    result = systemd_verify(tmp_path, ["spot-agent.service"])
    assert result.returncode == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if "spot-agent" in line or "shared-release" in line]


def test_head_node_mounts_lustre_makes_the_data_directory_and_can_pull_datasets(
    lustre: Deployment, imported: Deployment
) -> None:
    head = files(head_document(lustre))
    assert shell_value(head["/usr/local/sbin/lustre-mount"], "SOURCE") == MOUNT_SOURCE
    setup = head["/usr/local/sbin/head-setup"]
    assert shell_value(setup, "MOUNT_PROGRAM") == "/usr/local/sbin/lustre-mount"
    assert shell_value(setup, "DATA_DIR") == "/shared/data"
    assert "/usr/local/bin/blob-pull" in head  # `stage` copies datasets in from the head node
    assert shell_value(files(head_document(imported))["/usr/local/sbin/head-setup"], "DATA_DIR") == ""


# --- the mount program, run against stub commands ---------------------------------------------------


def lustre_mount_in(sandbox: Sandbox, lustre: Deployment, *, client: bool) -> tuple[str, Any]:
    script = files(node_document(lustre))["/usr/local/sbin/lustre-mount"]
    mount_path = sandbox.root / "shared"
    script = with_value(script, "MOUNT_PATH", str(mount_path))
    script = with_value(script, "FSTAB", str(sandbox.root / "fstab"))
    (sandbox.root / "fstab").write_text("UUID=1234 / ext4 defaults 0 1\n")
    sandbox.stub("mountpoint", '[ -f "$STUB_STATE/mounted" ]')
    sandbox.stub("mount", 'touch "$STUB_STATE/mounted"')
    sandbox.stub("systemctl")
    if client:
        sandbox.stub("mount.lustre")
    return script, mount_path


def test_lustre_mount_adds_its_fstab_entry_and_mounts(sandbox: Sandbox, lustre: Deployment) -> None:
    script, mount_path = lustre_mount_in(sandbox, lustre, client=True)
    result = sandbox.run(script)
    assert result.returncode == 0, result.stderr
    assert (sandbox.root / "fstab").read_text().splitlines()[1:] == [
        f"{MOUNT_SOURCE} {mount_path} lustre noatime,flock,_netdev,nofail,x-systemd.before=slurmd.service 0 0"
    ]
    assert sandbox.calls("mount") == [f"mount {mount_path}"]


def test_lustre_mount_without_a_client_fails_saying_so(sandbox: Sandbox, lustre: Deployment) -> None:
    script, _ = lustre_mount_in(sandbox, lustre, client=False)
    result = sandbox.run(script)
    assert result.returncode == 1
    # the last line is the boot report's reason, and so the drained node's (the health check)
    assert result.stderr.strip().splitlines()[-1] == (
        "lustre-mount: no Lustre client on this image (mount.lustre not found): use an ubuntu-hpc image, "
        "which carries one"
    )
    assert sandbox.calls("mount") == []
