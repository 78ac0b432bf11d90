"""The deployment under mocks: assertions on what the program sends to Azure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from infra.azure_limits import COMPUTER_NAME_PREFIX, LINUX_COMPUTER_NAME, RESOURCE_NAME_RULES
from infra.cloud_init.slurm import KILL_WAIT_S
from infra.config import AUTONAME_SUFFIX, MAX_NODES, parse_config
from infra.contract import (
    DCGM_EXPORTER_PORT,
    NODE_EXPORTER_PORT,
    PROMETHEUS_PORT,
    SLURMCTLD_PORT,
    SLURMD_PORT,
    SRUN_PORT_RANGE,
    StackOutput,
)
from infra.identity import ACR_PULL, SCALE_SET_POWER_ACTIONS, STORAGE_BLOB_DATA_CONTRIBUTOR
from infra.key_vault import (
    DATABASE_PASSWORD_CONTENT_TYPE,
    KEY_VAULT_SECRETS_USER,
    MUNGE_KEY_CONTENT_TYPE,
    MUNGE_KEY_LIFETIME,
    munge_key_expiry,
)
from infra.network import DENY_ALL_PRIORITY, SERVICE_ENDPOINTS
from infra.skus import GPU_SKUS
from tests.infra.azure_mocks import (
    JUMPBOX_IP,
    MOCK_SAS,
    MUNGE_KEY,
    OPERATOR_OBJECT_ID,
    SUBSCRIPTION,
    Registered,
)
from tests.infra.conftest import LUSTRE_CONFIG, PROJECT, SSH_KEY, STACK, VALID_CONFIG, Deployment, deploy
from tests.infra.documents import decode_custom_data, setup_packages

# Azure resource types that take no tags (sub-resources and extension resources).
UNTAGGABLE = (":Subnet", ":BlobContainer", ":BlobServiceProperties", ":RoleAssignment", ":RoleDefinition")
HEAD_IP = "10.40.63.254"  # the last usable address of the cluster subnet 10.40.0.0/18
NODE_NAMES = ["hvd-gpu-000000", "hvd-gpu-000001", "hvd-gpu-000002", "hvd-gpu-000003"]


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
    assert counts["ResourceGroup"] == 2  # the cluster's, and the data's (kept by destroy)
    assert counts["VirtualNetwork"] == 1
    assert counts["Subnet"] >= 3
    assert counts["NetworkSecurityGroup"] >= 2
    assert counts["StorageAccount"] == 1 and counts["BlobContainer"] == 2
    # the nodes', the head node's (power) and its MLflow server's (results)
    assert counts["Registry"] == 1 and counts["UserAssignedIdentity"] == 3
    assert counts["RoleAssignment"] >= 3 and counts["RoleDefinition"] == 1
    assert counts["VirtualMachine"] == 3  # jumpbox, NFS server, head node
    assert counts["PublicIPAddress"] == 1
    assert counts["ProximityPlacementGroup"] == 1 and counts["VirtualMachineScaleSet"] == 1


def test_components_parent_their_children(deployment: Deployment) -> None:
    components = [r for r in deployment.mocks.resources if r.type.startswith("hvd:infra:")]
    assert {r.type.split(":")[-1] for r in components} >= {
        "Network", "Storage", "Registry", "ClusterIdentity", "Jumpbox", "NfsServer", "GpuCluster",
        "HeadNode", "ScaleSetPowerIdentity", "MungeKey",
    }  # fmt: skip


def test_every_resource_in_the_cluster_group_but_the_data_in_its_own(deployment: Deployment) -> None:
    group, data = by_name(deployment, ":ResourceGroup", "hvd-rg"), by_name(deployment, ":ResourceGroup", "-data-rg")
    others = [
        r
        for r in deployment.mocks.of_type("")
        if r not in (group, data) and not r.type.endswith(("Assignment", "Definition"))
    ]
    assert others
    kept = (":StorageAccount", ":BlobContainer", ":BlobServiceProperties")
    for resource in others:
        expected = data if resource.type.endswith(kept) else group
        assert resource.inputs.get("resourceGroupName") == expected.outputs["name"], resource.name


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


def node_document(deployment: Deployment) -> str:
    """The GPU nodes' cloud-config."""
    os_profile = one(deployment, ":VirtualMachineScaleSet").inputs["virtualMachineProfile"]["osProfile"]
    return decode_custom_data(os_profile["customData"])


def head_document(deployment: Deployment) -> str:
    """The head node's cloud-config."""
    return decode_custom_data(by_name(deployment, ":VirtualMachine", "head").inputs["osProfile"]["customData"])


def custom_data(deployment: Deployment) -> dict[str, str]:
    """Every cloud-config the deployment declares, by the resource that carries it (VMs, the scale set)."""
    documents = {
        vm.name: decode_custom_data(vm.inputs["osProfile"]["customData"])
        for vm in deployment.mocks.of_type(":VirtualMachine")
        if vm.inputs.get("osProfile", {}).get("customData")
    }
    return {**documents, one(deployment, ":VirtualMachineScaleSet").name: node_document(deployment)}


def head_file(deployment: Deployment, path: str) -> str:
    return next(e["content"] for e in yaml.safe_load(head_document(deployment))["write_files"] if e["path"] == path)


def slurm_settings(deployment: Deployment) -> dict[str, str]:
    """slurm.conf as key -> value; the node and partition lines under 'NodeName' and 'PartitionName'."""
    lines = head_file(deployment, "/etc/slurm/slurm.conf").splitlines()
    return {line.split("=", 1)[0]: line.split("=", 1)[1] for line in lines if line and not line.startswith("#")}


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
    assert cluster == {
        "AllowSlurmInCluster": "10.40.0.0/18",
        "AllowClusterInternal": "10.40.0.0/18",
        "AllowSshFromJumpbox": "10.40.128.0/18",
    }


def test_subnets_are_standalone_with_nsgs_and_storage_endpoints(deployment: Deployment) -> None:
    vnet = one(deployment, ":VirtualNetwork")
    assert "subnets" not in vnet.inputs
    subnets = {r.name.removeprefix("hvd-net-"): r.inputs for r in deployment.mocks.of_type(":Subnet")}
    assert {role: s["addressPrefix"] for role, s in subnets.items()} == parse_config(VALID_CONFIG).subnets
    nsg_ids = {r.id for r in deployment.mocks.of_type(":NetworkSecurityGroup")}
    assert {s["networkSecurityGroup"]["id"] for s in subnets.values()} == nsg_ids
    endpoints = {role: [e["service"] for e in s.get("serviceEndpoints", [])] for role, s in subnets.items()}
    assert endpoints == {
        "cluster": ["Microsoft.Storage", "Microsoft.KeyVault"],
        "nfs": ["Microsoft.Storage"],
        "jumpbox": [],
    }


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
    identity = by_name(deployment, ":UserAssignedIdentity", "-cluster-")
    head = by_name(deployment, ":UserAssignedIdentity", "-head-")
    mlflow = by_name(deployment, ":UserAssignedIdentity", "-mlflow-")
    power_role = one(deployment, ":RoleDefinition").outputs["name"]
    scale_set = one(deployment, ":VirtualMachineScaleSet")
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
        (head.outputs["principalId"], power_role, scale_set.id),
        # the munge key: the head node's and the nodes' identities read that one secret, nobody else
        (principal, KEY_VAULT_SECRETS_USER, by_name(deployment, ":Secret", "munge-key").id),
        (head.outputs["principalId"], KEY_VAULT_SECRETS_USER, by_name(deployment, ":Secret", "munge-key").id),
        # slurmdbd's database password: the head node's alone
        (head.outputs["principalId"], KEY_VAULT_SECRETS_USER, by_name(deployment, ":Secret", "database-password").id),
        # the head node's MLflow server writes its artifacts (the runs' models) to `results` alone
        (mlflow.outputs["principalId"], STORAGE_BLOB_DATA_CONTRIBUTOR, containers["results"]),
    }
    # Nothing at account, group or subscription scope.
    assert not any(scope.endswith(("StorageAccount/hvdsa", "ResourceGroup/hvd-rg")) for *_, scope in grants)


def test_role_definitions_are_subscription_qualified(deployment: Deployment) -> None:
    client_config_calls = [token for token, _ in deployment.mocks.calls if token.endswith(":getClientConfig")]
    assert len(client_config_calls) == 5  # once per component that grants roles, not once per grant
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
    identity = by_name(deployment, ":UserAssignedIdentity", "-cluster-")
    assert vmss.inputs["identity"] == {"type": "UserAssigned", "userAssignedIdentities": [identity.id]}
    assert list(vmss.outputs["identity"]["userAssignedIdentities"]) == [identity.id]


def test_node_cloud_init_is_wired_to_nfs_registry_identity_and_the_head_node(deployment: Deployment) -> None:
    document = node_document(deployment)
    assert document.startswith("#cloud-config")
    registry = one(deployment, ":Registry").outputs["loginServer"]
    identity = by_name(deployment, ":UserAssignedIdentity", "-cluster-").outputs["clientId"]
    for expected in ("10.40.64.4", "/export", "/shared", registry, identity, f"{HEAD_IP}:6817"):
        assert expected in document, expected
    assert "NCCL_IB_DISABLE" not in document
    # The size's local NVMe disks (8 on ND H100 v5) become the scratch volume at /nvme.
    assert re.search(r"^ +EXPECTED_DISKS=8$", document, re.MULTILINE)
    assert re.search(r"^ +MOUNT_PATH=/nvme$", document, re.MULTILINE)


def test_password_authentication_disabled_everywhere(deployment: Deployment) -> None:
    profiles = [vm.inputs["osProfile"] for vm in deployment.mocks.of_type(":VirtualMachine")]
    profiles += [one(deployment, ":VirtualMachineScaleSet").inputs["virtualMachineProfile"]["osProfile"]]
    assert len(profiles) == 4
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
    cloud_config = decode_custom_data(vm.inputs["osProfile"]["customData"])
    assert "10.40.0.0/18" in cloud_config  # exported to the cluster subnet
    (blob_pull,) = [e for e in yaml.safe_load(cloud_config)["write_files"] if e["path"] == "/usr/local/bin/blob-pull"]
    assert (
        blob_pull["content"] == (Path(__file__).parents[2] / "dtrain" / "remote" / "boot" / "blob_pull.py").read_text()
    )


def test_outputs_are_known_and_complete(deployment: Deployment) -> None:
    outputs = {key: out.value for key, out in deployment.outputs.items()}
    assert all(out.known for out in deployment.outputs.values())
    assert outputs["jumpbox_public_ip"] == JUMPBOX_IP
    assert outputs["nfs_private_ip"] == "10.40.64.4"
    assert outputs["nfs_export_path"] == "/export"
    assert outputs["shared_mount_path"] == "/shared" and outputs["data_path"] == "/shared/data"
    assert outputs["local_data_path"] == "/nvme/data"
    assert "node_registry_path" not in outputs  # Slurm knows the nodes
    assert outputs["data_container"] == "data" and outputs["results_container"] == "results"
    assert outputs["acr_login_server"] == one(deployment, ":Registry").outputs["loginServer"]
    assert outputs["blob_endpoint"] == f"https://{outputs['storage_account']}.blob.core.windows.net/"
    assert outputs["node_count"] == 4 and outputs["gpus_per_node"] == 8
    assert outputs["admin_user"] == "hpcadmin"
    assert outputs["scale_set_name"] == one(deployment, ":VirtualMachineScaleSet").outputs["name"]
    cluster_identity = by_name(deployment, ":UserAssignedIdentity", "-cluster-")
    assert outputs["cluster_identity_client_id"] == cluster_identity.outputs["clientId"]
    assert "NCCL_IB_DISABLE" not in outputs["nccl_env"]
    assert outputs["head_private_ip"] == HEAD_IP and outputs["head_hostname"] == "hvd-head"
    assert outputs["slurm_partition"] == "gpu" and outputs["slurm_cluster_name"] == "hvd"
    # the partitions' DefaultTime and MaxTime when the config names none: a day, no cap
    assert (outputs["default_job_time"], outputs["max_job_time"]) == ("24:00:00", "INFINITE")


def test_outputs_are_the_contracts(deployment: Deployment) -> None:
    assert sorted(deployment.outputs) == sorted(StackOutput)


def test_contract_imports_without_pulumi_or_pydantic() -> None:
    """The operator's CLI reads the contract without the Pulumi program's dependencies."""
    check = "import sys, infra.contract; sys.exit(sorted({'pulumi', 'pydantic'} & set(sys.modules)) or 0)"
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=Path(__file__).parents[2], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


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
    assert len(profiles) == 4, profiles
    return profiles


def test_encryption_at_host_on_every_machine(deployment: Deployment) -> None:
    assert _security_profiles(deployment) == {
        "hvd-jumpbox-vm": {"encryptionAtHost": True},
        "hvd-nfs-vm": {"encryptionAtHost": True},
        "hvd-head-vm": {"encryptionAtHost": True},
        "hvd-gpu-vmss": {"encryptionAtHost": True},
    }


@pytest.mark.parametrize(("raw", "size"), [({}, 128), ({"headOsDiskSizeGb": "256"}, 256)])
def test_the_head_nodes_os_disk_takes_the_configured_size(raw: dict[str, str], size: int) -> None:
    """The image's own disk is too small for the image, Prometheus, MLflow and slurmctld's state; a new
    size rebuilds the head node (Azure grows an OS disk only while its VM is deallocated)."""
    deployed = deploy({**VALID_CONFIG, **raw})
    disks = {
        vm.name: vm.inputs["storageProfile"]["osDisk"].get("diskSizeGB")
        for vm in deployed.mocks.of_type(":VirtualMachine")
    }
    assert disks == {"hvd-jumpbox-vm": None, "hvd-nfs-vm": None, "hvd-head-vm": size}


def test_encryption_at_host_opt_out_turns_it_off_everywhere() -> None:
    deployed = deploy({**VALID_CONFIG, "encryptionAtHost": "false"})
    profiles = _security_profiles(deployed)
    assert [profile["encryptionAtHost"] for profile in profiles.values()] == [False] * 4


# --- Slurm: the head node, its power role, the munge key, the ports ---------------------------


def test_head_power_role_has_only_start_deallocate_and_instance_view_on_the_scale_set(deployment: Deployment) -> None:
    scale_set = one(deployment, ":VirtualMachineScaleSet")
    role = one(deployment, ":RoleDefinition")
    assert role.inputs["permissions"] == [{"actions": list(SCALE_SET_POWER_ACTIONS)}]
    assert sorted(SCALE_SET_POWER_ACTIONS) == [
        "Microsoft.Compute/virtualMachineScaleSets/deallocate/action",
        "Microsoft.Compute/virtualMachineScaleSets/start/action",
        "Microsoft.Compute/virtualMachineScaleSets/virtualMachines/instanceView/read",
    ]
    assert role.inputs["assignableScopes"] == [scale_set.id]
    assert role.inputs["scope"] == scale_set.id
    assert role.inputs["roleType"] == "CustomRole"
    assert scale_set.id in role.inputs["roleName"]  # custom role names are unique per tenant
    (assignment,) = [
        r
        for r in deployment.mocks.of_type(":RoleAssignment")
        if r.inputs["roleDefinitionId"].endswith(role.outputs["name"])
    ]
    head = by_name(deployment, ":UserAssignedIdentity", "-head-")
    assert assignment.inputs["scope"] == scale_set.id
    assert assignment.inputs["principalId"] == head.outputs["principalId"]
    assert assignment.inputs["principalType"] == "ServicePrincipal"
    assert assignment.inputs["roleDefinitionId"] == (
        f"/subscriptions/{SUBSCRIPTION}/providers/Microsoft.Authorization/roleDefinitions/{role.outputs['name']}"
    )


def test_head_node_is_private_in_the_cluster_subnet_with_its_own_identity(deployment: Deployment) -> None:
    vm = by_name(deployment, ":VirtualMachine", "head")
    nic = by_name(deployment, ":NetworkInterface", "head").inputs["ipConfigurations"][0]
    assert "publicIPAddress" not in nic
    assert nic["subnet"]["id"] == by_name(deployment, ":Subnet", "-cluster").id
    assert (nic["privateIPAllocationMethod"], nic["privateIPAddress"]) == ("Static", HEAD_IP)
    head_identity = by_name(deployment, ":UserAssignedIdentity", "-head-")
    mlflow_identity = by_name(deployment, ":UserAssignedIdentity", "-mlflow-")
    identities = [head_identity.id, mlflow_identity.id]
    assert vm.inputs["identity"] == {"type": "UserAssigned", "userAssignedIdentities": identities}
    assert vm.inputs["osProfile"]["computerName"] == "hvd-head"
    # The nodes' image: Microsoft's Slurm repository, its key and the apt pin, as on the nodes.
    image = vm.inputs["storageProfile"]["imageReference"]
    vmss_image = one(deployment, ":VirtualMachineScaleSet").inputs["virtualMachineProfile"]["storageProfile"]
    assert image == vmss_image["imageReference"]
    assert (image["publisher"], image["offer"], image["sku"]) == ("microsoft-dsvm", "ubuntu-hpc", "2204")
    # The scale set's identity is not on the head node, nor the head node's on the scale set.
    vmss = one(deployment, ":VirtualMachineScaleSet")
    assert head_identity.id not in vmss.inputs["identity"]["userAssignedIdentities"]


def test_slurm_conf_has_the_partition_gres_power_saving_and_health_check(deployment: Deployment) -> None:
    settings = slurm_settings(deployment)
    sku = GPU_SKUS[VALID_CONFIG["gpuSku"]]
    assert settings["NodeName"] == (
        f"{','.join(NODE_NAMES)} CPUs={sku.vcpus} RealMemory={sku.slurm_real_memory_mb} Gres=gpu:8 State=CLOUD"
    )
    assert settings["PartitionName"].startswith("gpu Nodes=ALL Default=YES")
    assert " DefaultTime=24:00:00 MaxTime=INFINITE " in settings["PartitionName"]
    assert settings["SlurmctldHost"] == f"hvd-head({HEAD_IP})"
    assert settings["SuspendTime"] == "1800"  # autostopMinutes' default, 30
    # a resume's boot, then Azure's node checks before slurmd registers (infra/head.py)
    assert settings["ResumeTimeout"] == "2700"
    assert "SuspendExcParts" not in settings
    assert settings["HealthCheckProgram"] == "/usr/local/sbin/slurm-health-check"
    assert settings["HealthCheckNodeState"] == "ANY"
    assert head_file(deployment, "/etc/slurm/gres.conf") == "Name=gpu File=/dev/nvidia[0-7]\n"
    # The programs slurm.conf names are the ones the documents install.
    head_paths = {e["path"] for e in yaml.safe_load(head_document(deployment))["write_files"]}
    node_paths = {e["path"] for e in yaml.safe_load(node_document(deployment))["write_files"]}
    assert {settings[key] for key in ("SuspendProgram", "ResumeProgram", "ResumeFailProgram")} <= head_paths
    assert {settings["HealthCheckProgram"], settings["Epilog"]} <= node_paths
    # KillWait: the time the batch script has after a TERM to close the run (infra/cloud_init/slurm.py)
    assert (settings["JobRequeue"], settings["KillWait"], settings["SlurmdTimeout"]) == ("0", str(KILL_WAIT_S), "300")


def test_head_node_gives_the_runs_directory_to_the_admin_user(deployment: Deployment) -> None:
    setup = head_file(deployment, "/usr/local/sbin/head-setup")
    assert {"SHARED_MOUNT=/shared", "RUNS_DIR=runs", "RUNS_OWNER=hpcadmin"} <= set(setup.splitlines())


def test_nodes_give_the_admin_user_docker_and_its_registry_login(deployment: Deployment) -> None:
    """Docker-runtime jobs run as the admin user (tests/scripts/test_docker_user.py)."""
    files = {e["path"]: e["content"] for e in yaml.safe_load(node_document(deployment))["write_files"]}
    assert "ADMIN_USER=hpcadmin" in files["/usr/local/sbin/node-setup"].splitlines()
    assert "ADMIN_USER=hpcadmin" in files["/usr/local/sbin/acr-login"].splitlines()


def test_node_names_are_the_scale_sets_computer_names() -> None:
    deployed = deploy({**VALID_CONFIG, "nodeCount": "37"})
    prefix = one(deployed, ":VirtualMachineScaleSet").inputs["virtualMachineProfile"]["osProfile"]["computerNamePrefix"]
    names = slurm_settings(deployed)["NodeName"].split()[0].split(",")
    # Instance i is the prefix and i in base 36, six digits.
    assert prefix == "hvd-gpu-"
    assert names[:2] + names[9:12] + names[-1:] == [
        "hvd-gpu-000000", "hvd-gpu-000001", "hvd-gpu-000009", "hvd-gpu-00000a", "hvd-gpu-00000b", "hvd-gpu-000010",
    ]  # fmt: skip
    assert len(names) == 37 and all(int(name.removeprefix(prefix), 36) == i for i, name in enumerate(names))
    power = json.loads(head_file(deployed, "/etc/slurm/azure-power.json"))
    assert power["node_prefix"] == prefix
    assert power["scale_set_id"] == one(deployed, ":VirtualMachineScaleSet").id
    assert power["identity_client_id"] == by_name(deployed, ":UserAssignedIdentity", "-head-").outputs["clientId"]


@pytest.mark.parametrize(("minutes", "suspend_time"), [("0", None), ("10", "600"), ("1440", "86400")])
def test_autostop_minutes_set_slurms_suspend_time(minutes: str, suspend_time: str | None) -> None:
    deployed = deploy({**VALID_CONFIG, "autostopMinutes": minutes})
    settings = slurm_settings(deployed)
    if suspend_time is None:  # never: the partition is excluded from suspending
        assert settings["SuspendExcParts"] == "gpu"
    else:
        assert settings["SuspendTime"] == suspend_time and "SuspendExcParts" not in settings
    assert settings["ResumeProgram"] == "/usr/local/sbin/slurm-resume"
    # the reaper: a first boot may take longer to register than a resume (installs, role propagation);
    # nodes that came up outside Slurm are powered down at once only where idle nodes are powered down at all
    power = json.loads(head_file(deployed, "/etc/slurm/azure-power.json"))
    assert power["register_timeout_s"] == 3600 > int(settings["ResumeTimeout"])
    assert power["power_down_unused"] is (suspend_time is not None)


def test_munge_key_goes_to_key_vault_and_never_into_custom_data(deployment: Deployment) -> None:
    (key,) = [r for r in deployment.mocks.resources if r.type == "random:index/randomBytes:RandomBytes"]
    assert key.inputs["length"] == 1024
    secret = by_name(deployment, ":Secret", "munge-key")
    assert secret.inputs["secretName"] == "slurm-munge-key" and secret.inputs["properties"]["value"] == MUNGE_KEY
    # The secrets themselves (the key, the database password) are the only inputs sent as secrets; no custom
    # data carries the key.
    password = by_name(deployment, ":Secret", "database-password")
    secrets = {(r.name, name) for r in deployment.mocks.resources for name in r.secret_inputs}
    assert secrets == {(secret.name, "properties"), (password.name, "properties")}
    for document in custom_data(deployment).values():
        assert MUNGE_KEY not in document and MUNGE_KEY[:40] not in document
        assert "/etc/munge/munge.key" not in {e["path"] for e in yaml.safe_load(document).get("write_files", [])}
    sent = json.dumps([r.inputs for r in deployment.mocks.resources if r not in (key, secret)], default=str)
    assert MUNGE_KEY not in sent
    assert MUNGE_KEY not in json.dumps({key: out.value for key, out in deployment.outputs.items()}, default=str)
    vault = one(deployment, ":Vault")
    for document in (head_document(deployment), node_document(deployment)):
        fetch = {e["path"]: e["content"] for e in yaml.safe_load(document)["write_files"]}["/usr/local/sbin/munge-key"]
        assert f"VAULT_URI={vault.outputs['properties']['vaultUri']}" in fetch.splitlines()


def test_key_vault_is_rbac_only_closed_to_all_but_the_cluster_subnet(deployment: Deployment) -> None:
    properties = one(deployment, ":Vault").inputs["properties"]
    assert properties["enableRbacAuthorization"] is True and "accessPolicies" not in properties
    acls = properties["networkAcls"]
    assert (acls["defaultAction"], acls["bypass"]) == ("Deny", "None")
    assert acls["virtualNetworkRules"] == [{"id": by_name(deployment, ":Subnet", "-cluster").id}]
    assert not acls.get("ipRules")


def test_key_vault_is_recoverable_purge_protected_and_reachable_only_through_its_firewall(
    deployment: Deployment,
) -> None:
    """Checkov's findings on the vault (issue 33): soft delete, purge protection, public access."""
    properties = one(deployment, ":Vault").inputs["properties"]
    assert properties["enableSoftDelete"] is True and properties["softDeleteRetentionInDays"] == 7
    assert properties["enablePurgeProtection"] is True
    # Enabled, behind a firewall that denies all but the cluster subnet: "Disabled" would override
    # that firewall, and without a private endpoint the hosts could no longer fetch the key.
    assert properties["publicNetworkAccess"] == "Enabled"
    assert properties["networkAcls"]["defaultAction"] == "Deny"
    assert "Microsoft.KeyVault" in SERVICE_ENDPOINTS["cluster"]
    assert not deployment.mocks.of_type(":PrivateEndpoint")  # the reason "Enabled" is kept
    # the URI the hosts fetch from resolved (built after the mocks: the checks above ran on real inputs)
    assert one(deployment, ":Vault").outputs["properties"]["vaultUri"].startswith("https://")


def test_purge_protection_can_be_left_off_for_throwaway_stacks() -> None:
    deployed = deploy({**VALID_CONFIG, "keyVaultPurgeProtection": "false"})
    properties = one(deployed, ":Vault").inputs["properties"]
    # Azure refuses `false`: off is the property left out, never sent as false
    assert "enablePurgeProtection" not in properties and properties["enableSoftDelete"] is True


@pytest.mark.parametrize(
    ("secret", "content_type"),
    [("munge-key", MUNGE_KEY_CONTENT_TYPE), ("database-password", DATABASE_PASSWORD_CONTENT_TYPE)],
)
def test_each_secret_has_a_content_type_and_an_expiry_a_year_ahead(
    deployment: Deployment, secret: str, content_type: str
) -> None:
    properties = by_name(deployment, ":Secret", secret).inputs["properties"]
    assert properties["contentType"] == content_type
    attributes = properties["attributes"]
    assert attributes["enabled"] is True
    expires = datetime.fromtimestamp(attributes["expires"], UTC)
    now = datetime.now(UTC)
    assert now + MUNGE_KEY_LIFETIME - timedelta(days=1) <= expires <= now + MUNGE_KEY_LIFETIME
    assert (expires.hour, expires.minute, expires.second) == (0, 0, 0)  # the same all day: no churn


def test_munge_key_expiry_moves_with_the_day_not_the_hour() -> None:
    morning = datetime(2026, 11, 27, 0, 0, 1, tzinfo=UTC)
    evening = datetime(2026, 11, 27, 23, 59, 59, tzinfo=UTC)
    assert munge_key_expiry(morning) == munge_key_expiry(evening) == int(datetime(2027, 11, 27, tzinfo=UTC).timestamp())
    assert munge_key_expiry(evening + timedelta(seconds=1)) - munge_key_expiry(evening) == 86400


def _covers(port_ranges: list[str], port: int) -> bool:
    def span(text: str) -> tuple[int, int]:
        low, _, high = text.partition("-")
        return (0, 65535) if text == "*" else (int(low), int(high or low))

    return any(low <= port <= high for low, high in map(span, port_ranges))


# Slurm's, and the telemetry's: Prometheus on the head node, the exporters it scrapes on every node
INTERNAL_PORTS = [
    SLURMCTLD_PORT,
    SLURMD_PORT,
    *SRUN_PORT_RANGE,
    PROMETHEUS_PORT,
    NODE_EXPORTER_PORT,
    DCGM_EXPORTER_PORT,
]


@pytest.mark.parametrize("port", INTERNAL_PORTS)
@pytest.mark.parametrize("role", ["cluster", "nfs", "jumpbox"])
def test_slurm_and_telemetry_ports_are_closed_outside_the_cluster_subnet(
    deployment: Deployment, role: str, port: int
) -> None:
    admitting = [
        rule
        for rule in _rules(deployment, role)
        if rule["access"] == "Allow"
        and _covers(rule.get("destinationPortRanges") or [rule["destinationPortRange"]], port)
    ]
    assert {rule["sourceAddressPrefix"] for rule in admitting} == ({"10.40.0.0/18"} if role == "cluster" else set())
    # The head node and the nodes are both in the cluster subnet, so that is where Slurm talks.
    cluster_subnet = by_name(deployment, ":Subnet", "-cluster").id
    head_nic = by_name(deployment, ":NetworkInterface", "head").inputs["ipConfigurations"][0]
    vmss = one(deployment, ":VirtualMachineScaleSet").inputs["virtualMachineProfile"]["networkProfile"]
    vmss_subnet = vmss["networkInterfaceConfigurations"][0]["ipConfigurations"][0]["subnet"]["id"]
    assert head_nic["subnet"]["id"] == vmss_subnet == cluster_subnet


# The longest prefixes the config admits: 10 characters, 9 with Spot nodes.
LONGEST_PREFIXES = [{"namePrefix": "abcdefghij"}, {"namePrefix": "abcdefghi", "spotNodeCount": "2"}]


@pytest.mark.parametrize(
    "raw",
    [*({**VALID_CONFIG, **overrides} for overrides in LONGEST_PREFIXES), {**LUSTRE_CONFIG, **LONGEST_PREFIXES[0]}],
    ids=["on-demand", "spot", "lustre"],
)
def test_every_name_the_longest_prefix_makes_is_one_azure_takes(raw: dict[str, str]) -> None:
    deployed = deploy(raw)
    checked = set()
    for resource in deployed.mocks.resources:
        rule = next((r for suffix, r in RESOURCE_NAME_RULES.items() if resource.type.endswith(suffix)), None)
        if rule is None:
            continue
        name = resource.name + AUTONAME_SUFFIX  # azure-native adds 8 random hex digits
        assert rule.admits(name), f"{resource.type} {name!r}: Azure allows {rule.allowed}"
        checked.add(resource.type.rsplit(":", 1)[1])
    # every rule met a resource it governs (Azure Managed Lustre's in the stack that has one)
    lustre = raw.get("sharedStorage") == "lustre"
    assert checked == {suffix[1:] for suffix in RESOURCE_NAME_RULES} - (set() if lustre else {"AmlFilesystem"})
    # the names the machines take, which azure-native leaves as given
    for vmss in deployed.mocks.of_type(":VirtualMachineScaleSet"):
        prefix = vmss.inputs["virtualMachineProfile"]["osProfile"]["computerNamePrefix"]
        assert COMPUTER_NAME_PREFIX.admits(prefix), prefix
    for vm in deployed.mocks.of_type(":VirtualMachine"):
        assert LINUX_COMPUTER_NAME.admits(vm.inputs["osProfile"]["computerName"])


@pytest.mark.parametrize("overrides", LONGEST_PREFIXES, ids=["on-demand", "spot"])
def test_config_checks_the_names_the_stack_makes(overrides: dict[str, str]) -> None:
    """infra/config.py derives the names to check them; the stack must make the same ones."""
    raw = {**VALID_CONFIG, **overrides}
    derived = parse_config(raw).derived_names
    deployed = deploy(raw)
    made = {
        "the storage account": one(deployed, ":StorageAccount").name + AUTONAME_SUFFIX,
        "the key vault": one(deployed, ":Vault").name + AUTONAME_SUFFIX,
        "the container registry": one(deployed, ":Registry").name + AUTONAME_SUFFIX,
        "the head node's host name": by_name(deployed, ":VirtualMachine", "-head-").inputs["osProfile"]["computerName"],
        "the jumpbox's host name": by_name(deployed, ":VirtualMachine", "-jumpbox-").inputs["osProfile"][
            "computerName"
        ],
        "the NFS server's host name": by_name(deployed, ":VirtualMachine", "-nfs-").inputs["osProfile"]["computerName"],
    }
    for kind, label in (("gpu", "GPU"), ("spot", "Spot")):
        scale_sets = [r for r in deployed.mocks.of_type(":VirtualMachineScaleSet") if f"-{kind}-" in r.name]
        for vmss in scale_sets:
            prefix = vmss.inputs["virtualMachineProfile"]["osProfile"]["computerNamePrefix"]
            made[f"the {label} nodes' computer name prefix"] = prefix
            made[f"a {label} node's host name"] = prefix + "000000"
    assert made == derived


def test_head_node_runs_prometheus_over_every_slurm_nodes_exporters_with_retention_bounded_by_size(
    deployment: Deployment,
) -> None:
    head = yaml.safe_load(head_document(deployment))
    assert "prometheus" in setup_packages(head_document(deployment))
    targets = json.loads(head_file(deployment, "/etc/prometheus/targets.json"))
    # every node slurm.conf names, each with node_exporter and the DCGM exporter, labelled with its Slurm name
    assert sorted((t["labels"]["node"], t["targets"][0]) for t in targets) == sorted(
        (name, f"{name}:{port}") for name in NODE_NAMES for port in (NODE_EXPORTER_PORT, DCGM_EXPORTER_PORT)
    )
    assert slurm_settings(deployment)["NodeName"].split()[0] == ",".join(NODE_NAMES)
    config = yaml.safe_load(head_file(deployment, "/etc/prometheus/prometheus.yml"))
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["/etc/prometheus/targets.json"]
    assert "--storage.tsdb.retention.size=10GB" in head_file(deployment, "/etc/default/prometheus")
    # installed by head-setup after cloud-init wrote its configuration, which the install keeps and starts with
    assert "prometheus" not in json.dumps(head["runcmd"])
    # the nodes: node_exporter from Ubuntu's package, NVIDIA's DCGM exporter (pinned) started by node-setup
    node = yaml.safe_load(node_document(deployment))
    assert "prometheus-node-exporter" in setup_packages(node_document(deployment))
    units = {e["path"]: e["content"] for e in node["write_files"]}
    assert "dcgm-exporter:4.5.2-4.8.1-ubuntu22.04" in units["/etc/systemd/system/dcgm-exporter.service"]
    assert "systemctl enable --now dcgm-exporter.service" in units["/usr/local/sbin/node-setup"]
