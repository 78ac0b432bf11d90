"""The deployment under mocks: assertions on what the program sends to Azure."""

from __future__ import annotations

import base64
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from infra.config import MAX_NODES, parse_config
from infra.identity import ACR_PULL, STORAGE_BLOB_DATA_CONTRIBUTOR
from infra.network import DENY_ALL_PRIORITY
from tests.infra.azure_mocks import JUMPBOX_IP, MOCK_SAS, OPERATOR_OBJECT_ID, Registered
from tests.infra.conftest import PROJECT, SSH_KEY, STACK, VALID_CONFIG, Deployment, deploy

# Azure resource types that take no tags (sub-resources and extension resources).
UNTAGGABLE = (":Subnet", ":BlobContainer", ":RoleAssignment")


def one(deployment: Deployment, suffix: str) -> Registered:
    found = deployment.mocks.of_type(suffix)
    assert len(found) == 1, f"expected one {suffix}, got {[r.name for r in found]}"
    return found[0]


def by_name(deployment: Deployment, suffix: str, fragment: str) -> Registered:
    found = [r for r in deployment.mocks.of_type(suffix) if fragment in r.name]
    assert len(found) == 1, f"expected one {suffix} named *{fragment}*, got {[r.name for r in found]}"
    return found[0]


def test_declares_the_whole_deployment(deployment: Deployment) -> None:
    counts = Counter(r.type.split(":")[-1] for r in deployment.mocks.of_type(""))
    assert counts["ResourceGroup"] == 1
    assert counts["VirtualNetwork"] == 1
    assert counts["Subnet"] >= 3
    assert counts["NetworkSecurityGroup"] >= 2
    assert counts["StorageAccount"] == 1 and counts["BlobContainer"] == 2
    assert counts["Registry"] == 1 and counts["UserAssignedIdentity"] == 1
    assert counts["RoleAssignment"] >= 2
    assert counts["VirtualMachine"] == 2  # jumpbox and NFS server
    assert counts["PublicIPAddress"] == 1
    assert counts["ProximityPlacementGroup"] == 1 and counts["VirtualMachineScaleSet"] == 1


def test_components_parent_their_children(deployment: Deployment) -> None:
    components = [r for r in deployment.mocks.resources if r.type.startswith("hvd:infra:")]
    assert {r.type.split(":")[-1] for r in components} >= {
        "Network", "Storage", "Registry", "ClusterIdentity", "Jumpbox", "NfsServer", "GpuCluster",
    }  # fmt: skip


def test_every_resource_in_the_one_group(deployment: Deployment) -> None:
    group = one(deployment, ":ResourceGroup")
    others = [r for r in deployment.mocks.of_type("") if r is not group and not r.type.endswith(":RoleAssignment")]
    assert others
    for resource in others:
        assert resource.inputs.get("resourceGroupName") == group.outputs["name"], resource.name


def test_tags_on_every_taggable_resource(deployment: Deployment) -> None:
    expected = {"project": PROJECT, "stack": STACK, "owner": "ml-platform@example.com", "costCenter": "ml-research"}
    taggable = [r for r in deployment.mocks.of_type("") if not r.type.endswith(UNTAGGABLE)]
    assert len(taggable) >= 12
    for resource in taggable:
        assert resource.inputs.get("tags") == expected, resource.name


def test_only_the_jumpbox_has_a_public_ip(deployment: Deployment) -> None:
    public_ip = one(deployment, ":PublicIPAddress")
    assert "jumpbox" in public_ip.name
    nics_with_public_ip = [
        nic.name
        for nic in deployment.mocks.of_type(":NetworkInterface")
        if any("publicIPAddress" in config for config in nic.inputs["ipConfigurations"])
    ]
    assert nics_with_public_ip == ["hvd-jumpbox-nic"]
    vmss = one(deployment, ":VirtualMachineScaleSet")
    for nic in vmss.inputs["virtualMachineProfile"]["networkProfile"]["networkInterfaceConfigurations"]:
        assert all("publicIPAddressConfiguration" not in c for c in nic["ipConfigurations"])


def _rules(deployment: Deployment, role: str) -> list[dict]:
    return by_name(deployment, ":NetworkSecurityGroup", f"-{role}-nsg").inputs["securityRules"]


@pytest.mark.parametrize("role", ["cluster", "nfs", "jumpbox"])
def test_nsgs_deny_inbound_by_default(deployment: Deployment, role: str) -> None:
    rules = _rules(deployment, role)
    deny = [r for r in rules if r["access"] == "Deny"]
    assert deny == [
        {
            "name": "DenyAllInbound",
            "priority": DENY_ALL_PRIORITY,
            "direction": "Inbound",
            "access": "Deny",
            "protocol": "*",
            "sourceAddressPrefix": "*",
            "sourcePortRange": "*",
            "destinationAddressPrefix": "*",
            "destinationPortRange": "*",
        }
    ]
    assert all(r["priority"] < DENY_ALL_PRIORITY for r in rules if r["access"] == "Allow")
    open_sources = ("*", "Internet", "0.0.0.0/0")
    assert all(r["sourceAddressPrefix"] not in open_sources for r in rules if r["access"] == "Allow")


def test_jumpbox_ssh_only_from_allowed_cidr(deployment: Deployment) -> None:
    allows = [r for r in _rules(deployment, "jumpbox") if r["access"] == "Allow"]
    assert [(r["sourceAddressPrefix"], r["destinationPortRanges"], r["protocol"]) for r in allows] == [
        ("203.0.113.0/24", ["22"], "Tcp")
    ]


def test_private_subnets_admit_only_the_vnet_roles_they_need(deployment: Deployment) -> None:
    nfs = {r["name"]: r for r in _rules(deployment, "nfs") if r["access"] == "Allow"}
    assert nfs["AllowNfsFromCluster"]["sourceAddressPrefix"] == "10.40.0.0/18"
    assert nfs["AllowNfsFromCluster"]["destinationPortRanges"] == ["2049"]
    assert nfs["AllowSshFromJumpbox"]["sourceAddressPrefix"] == "10.40.128.0/18"
    cluster = {r["name"]: r["sourceAddressPrefix"] for r in _rules(deployment, "cluster") if r["access"] == "Allow"}
    assert cluster == {"AllowClusterInternal": "10.40.0.0/18", "AllowSshFromJumpbox": "10.40.128.0/18"}


def test_subnets_are_standalone_with_nsgs_and_storage_endpoints(deployment: Deployment) -> None:
    vnet = one(deployment, ":VirtualNetwork")
    assert "subnets" not in vnet.inputs
    subnets = {r.name.removeprefix("hvd-net-"): r.inputs for r in deployment.mocks.of_type(":Subnet")}
    assert {role: s["addressPrefix"] for role, s in subnets.items()} == parse_config(VALID_CONFIG).subnets
    nsg_ids = {r.id for r in deployment.mocks.of_type(":NetworkSecurityGroup")}
    assert {s["networkSecurityGroup"]["id"] for s in subnets.values()} == nsg_ids
    endpoints = {role: [e["service"] for e in s.get("serviceEndpoints", [])] for role, s in subnets.items()}
    assert endpoints == {"cluster": ["Microsoft.Storage"], "nfs": ["Microsoft.Storage"], "jumpbox": []}


def test_storage_account_is_locked_down(deployment: Deployment) -> None:
    account = one(deployment, ":StorageAccount").inputs
    assert account["kind"] == "StorageV2"
    assert account["enableHttpsTrafficOnly"] is True
    assert account["minimumTlsVersion"] == "TLS1_2"
    assert account["allowBlobPublicAccess"] is False
    rules = account["networkRuleSet"]
    assert rules["defaultAction"] == "Deny"
    subnet_ids = {r.name: r.id for r in deployment.mocks.of_type(":Subnet")}
    assert {r["virtualNetworkResourceId"] for r in rules["virtualNetworkRules"]} == {
        subnet_ids["hvd-net-cluster"],
        subnet_ids["hvd-net-nfs"],
    }
    assert [r["iPAddressOrRange"] for r in rules["ipRules"]] == ["203.0.113.0/24"]


def test_containers_are_private(deployment: Deployment) -> None:
    containers = {r.inputs["containerName"]: r.inputs for r in deployment.mocks.of_type(":BlobContainer")}
    assert set(containers) == {"data", "results"}
    assert all(c["publicAccess"] == "None" for c in containers.values())


def test_data_sas_is_read_list_https_container_scoped(deployment: Deployment) -> None:
    calls = [args for token, args in deployment.mocks.calls if token.endswith(":listStorageAccountServiceSAS")]
    assert len(calls) == 1
    sas = calls[0]
    account = one(deployment, ":StorageAccount").outputs["name"]
    assert sas["permissions"] == "rl"
    assert sas["protocols"] == "https"
    assert sas["resource"] == "c"
    assert sas["canonicalizedResource"] == f"/blob/{account}/data"
    expiry = datetime.strptime(sas["sharedAccessExpiryTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert timedelta(days=29) < expiry - datetime.now(UTC) < timedelta(days=31)


def test_data_sas_output_is_secret(deployment: Deployment) -> None:
    sas = deployment.outputs["data_sas"]
    assert sas.known and sas.secret and sas.value == MOCK_SAS
    assert [key for key, out in deployment.outputs.items() if out.secret] == ["data_sas"]


def test_registry_admin_disabled(deployment: Deployment) -> None:
    registry = one(deployment, ":Registry").inputs
    assert registry["adminUserEnabled"] is False
    assert registry["anonymousPullEnabled"] is False


def test_role_assignment_scopes(deployment: Deployment) -> None:
    identity = one(deployment, ":UserAssignedIdentity")
    registry = one(deployment, ":Registry")
    containers = {r.inputs["containerName"]: r.id for r in deployment.mocks.of_type(":BlobContainer")}
    grants = {
        (r.inputs["principalId"], r.inputs["roleDefinitionId"].rsplit("/", 1)[-1], r.inputs["scope"])
        for r in deployment.mocks.of_type(":RoleAssignment")
    }
    principal = identity.outputs["principalId"]
    assert grants == {
        (principal, ACR_PULL, registry.id),
        (principal, STORAGE_BLOB_DATA_CONTRIBUTOR, containers["results"]),
        (OPERATOR_OBJECT_ID, STORAGE_BLOB_DATA_CONTRIBUTOR, containers["data"]),
        (OPERATOR_OBJECT_ID, STORAGE_BLOB_DATA_CONTRIBUTOR, containers["results"]),
    }
    # Nothing at account, group or subscription scope.
    assert not any(scope.endswith(("StorageAccount/hvdsa", "ResourceGroup/hvd-rg")) for *_, scope in grants)


def test_role_definitions_are_subscription_qualified(deployment: Deployment) -> None:
    client_config_calls = [token for token, _ in deployment.mocks.calls if token.endswith(":getClientConfig")]
    assert len(client_config_calls) == 2  # once per identity component, not once per grant
    for assignment in deployment.mocks.of_type(":RoleAssignment"):
        assert assignment.inputs["roleDefinitionId"].startswith(
            "/subscriptions/00000000-0000-0000-0000-0000000000aa/providers/Microsoft.Authorization/roleDefinitions/"
        )


def test_scale_set_flags(deployment: Deployment) -> None:
    vmss = one(deployment, ":VirtualMachineScaleSet")
    inputs = vmss.inputs
    assert inputs["orchestrationMode"] == "Uniform"
    assert inputs["sku"] == {"name": "Standard_ND96isr_H100_v5", "tier": "Standard", "capacity": 4}
    assert inputs["singlePlacementGroup"] is True
    assert inputs["overprovision"] is False
    assert inputs["proximityPlacementGroup"]["id"] == one(deployment, ":ProximityPlacementGroup").id
    profile = inputs["virtualMachineProfile"]
    image = profile["storageProfile"]["imageReference"]
    assert (image["publisher"], image["offer"], image["sku"]) == ("microsoft-dsvm", "ubuntu-hpc", "2204")
    nic = profile["networkProfile"]["networkInterfaceConfigurations"][0]
    assert nic["enableAcceleratedNetworking"] is True
    subnet = by_name(deployment, ":Subnet", "-cluster")
    assert nic["ipConfigurations"][0]["subnet"]["id"] == subnet.id


def test_scale_set_uses_the_cluster_identity(deployment: Deployment) -> None:
    vmss = one(deployment, ":VirtualMachineScaleSet")
    identity = one(deployment, ":UserAssignedIdentity")
    assert vmss.inputs["identity"] == {"type": "UserAssigned", "userAssignedIdentities": [identity.id]}
    assert list(vmss.outputs["identity"]["userAssignedIdentities"]) == [identity.id]


def test_node_cloud_init_is_wired_to_nfs_registry_and_identity(deployment: Deployment) -> None:
    vmss = one(deployment, ":VirtualMachineScaleSet")
    custom_data = vmss.inputs["virtualMachineProfile"]["osProfile"]["customData"]
    document = base64.b64decode(custom_data).decode()
    assert document.startswith("#cloud-config")
    registry = one(deployment, ":Registry").outputs["loginServer"]
    identity = one(deployment, ":UserAssignedIdentity").outputs["clientId"]
    for expected in ("10.40.64.4", "/export", "/shared/nodes", registry, identity):
        assert expected in document, expected
    assert "NCCL_IB_DISABLE" not in document


def test_password_authentication_disabled_everywhere(deployment: Deployment) -> None:
    profiles = [vm.inputs["osProfile"] for vm in deployment.mocks.of_type(":VirtualMachine")]
    profiles += [one(deployment, ":VirtualMachineScaleSet").inputs["virtualMachineProfile"]["osProfile"]]
    assert len(profiles) == 3
    for profile in profiles:
        assert "adminPassword" not in profile
        linux = profile["linuxConfiguration"]
        assert linux["disablePasswordAuthentication"] is True
        assert linux["ssh"]["publicKeys"] == [{"keyData": SSH_KEY, "path": "/home/hpcadmin/.ssh/authorized_keys"}]


def test_nfs_server_disks_and_static_private_ip(deployment: Deployment) -> None:
    vm = by_name(deployment, ":VirtualMachine", "nfs")
    disks = vm.inputs["storageProfile"]["dataDisks"]
    assert [d["lun"] for d in disks] == [0, 1, 2, 3]
    assert all(d["createOption"] == "Empty" and d["managedDisk"]["storageAccountType"] == "Premium_LRS" for d in disks)
    nic = by_name(deployment, ":NetworkInterface", "nfs").inputs["ipConfigurations"][0]
    assert nic["privateIPAllocationMethod"] == "Static" and nic["privateIPAddress"] == "10.40.64.4"
    assert nic["subnet"]["id"] == by_name(deployment, ":Subnet", "-nfs").id
    cloud_config = base64.b64decode(vm.inputs["osProfile"]["customData"]).decode()
    assert "10.40.0.0/18" in cloud_config  # exported to the cluster subnet


def test_outputs_are_known_and_complete(deployment: Deployment) -> None:
    outputs = {key: out.value for key, out in deployment.outputs.items()}
    assert all(out.known for out in deployment.outputs.values())
    assert outputs["jumpbox_public_ip"] == JUMPBOX_IP
    assert outputs["nfs_private_ip"] == "10.40.64.4"
    assert outputs["nfs_export_path"] == "/export"
    assert outputs["node_registry_path"] == "/shared/nodes"
    assert outputs["data_container"] == "data" and outputs["results_container"] == "results"
    assert outputs["acr_login_server"] == one(deployment, ":Registry").outputs["loginServer"]
    assert outputs["blob_endpoint"] == f"https://{outputs['storage_account']}.blob.core.windows.net/"
    assert outputs["node_count"] == 4 and outputs["gpus_per_node"] == 8
    assert outputs["admin_user"] == "hpcadmin"
    assert outputs["scale_set_name"] == one(deployment, ":VirtualMachineScaleSet").outputs["name"]
    assert outputs["cluster_identity_client_id"] == one(deployment, ":UserAssignedIdentity").outputs["clientId"]
    assert "NCCL_IB_DISABLE" not in outputs["nccl_env"]


@pytest.mark.parametrize("nodes", [1, MAX_NODES])
def test_node_count_bounds_reach_the_scale_set(nodes: int) -> None:
    deployed = deploy({**VALID_CONFIG, "nodeCount": str(nodes)})
    assert one(deployed, ":VirtualMachineScaleSet").inputs["sku"]["capacity"] == nodes


def test_open_ssh_keeps_storage_closed() -> None:
    deployed = deploy({**VALID_CONFIG, "allowedSshCidr": "0.0.0.0/0", "allowOpenSsh": "true"})
    assert one(deployed, ":StorageAccount").inputs["networkRuleSet"].get("ipRules", []) == []
    allows = [r for r in _rules(deployed, "jumpbox") if r["access"] == "Allow"]
    assert [r["sourceAddressPrefix"] for r in allows] == ["0.0.0.0/0"]


def _security_profiles(deployed: Deployment) -> dict[str, dict]:
    """Each machine's securityProfile as sent to Azure: the two VMs and the scale set's model."""
    profiles = {vm.name: vm.inputs.get("securityProfile", {}) for vm in deployed.mocks.of_type(":VirtualMachine")}
    vmss = one(deployed, ":VirtualMachineScaleSet")
    profiles[vmss.name] = vmss.inputs["virtualMachineProfile"].get("securityProfile", {})
    assert len(profiles) == 3, profiles
    return profiles


def test_encryption_at_host_on_every_machine(deployment: Deployment) -> None:
    assert _security_profiles(deployment) == {
        "hvd-jumpbox-vm": {"encryptionAtHost": True},
        "hvd-nfs-vm": {"encryptionAtHost": True},
        "hvd-gpu-vmss": {"encryptionAtHost": True},
    }


def test_encryption_at_host_opt_out_turns_it_off_everywhere() -> None:
    deployed = deploy({**VALID_CONFIG, "encryptionAtHost": "false"})
    profiles = _security_profiles(deployed)
    assert [profile["encryptionAtHost"] for profile in profiles.values()] == [False, False, False]
