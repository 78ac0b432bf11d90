"""The data that outlives `pulumi destroy` (Pulumi mocks): storage in a resource group of its own, retained on
delete while the cluster is not, with blob soft delete and versioning, and no cluster resource in it."""

from __future__ import annotations

from typing import Any

import pytest
from pulumi.runtime import mocks

from infra.identity import STORAGE_BLOB_DATA_CONTRIBUTOR
from infra.storage import SOFT_DELETE_DAYS
from tests.infra.azure_mocks import OPERATOR_OBJECT_ID
from tests.infra.conftest import KEPT_ACCOUNT_ID, PROJECT, STACK, VALID_CONFIG, Deployment, deploy
from tests.infra.test_stack import by_name, one


def test_the_data_has_its_own_group_and_nothing_of_the_cluster_is_in_it(deployment: Deployment) -> None:
    data = by_name(deployment, ":ResourceGroup", "-data-rg")
    in_data = {r.type.rsplit(":", 1)[-1] for r in deployment.mocks.of_type("") if
               r.inputs.get("resourceGroupName") == data.outputs["name"]}  # fmt: skip
    assert in_data == {"StorageAccount", "BlobContainer", "BlobServiceProperties"}
    assert deployment.outputs["data_resource_group"].value == data.outputs["name"]
    assert deployment.outputs["resource_group"].value != data.outputs["name"]


def test_results_have_soft_delete_and_versioning(deployment: Deployment) -> None:
    service = one(deployment, ":BlobServiceProperties")
    account = one(deployment, ":StorageAccount")
    assert service.inputs["accountName"] == account.outputs["name"]
    assert service.inputs["blobServicesName"] == "default"
    assert service.inputs["isVersioningEnabled"] is True
    retention = {"enabled": True, "days": SOFT_DELETE_DAYS}
    assert service.inputs["deleteRetentionPolicy"] == retention
    assert service.inputs["containerDeleteRetentionPolicy"] == retention


def test_destroy_deletes_everything_but_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pulumi destroy` calls each provider's Delete for every resource of the stack except those registered
    with retainOnDelete: exactly the data's group, account, containers and blob settings."""
    retained: dict[str, bool] = {}
    register = mocks.MockMonitor.RegisterResource

    def recording(self: mocks.MockMonitor, request: Any) -> Any:
        retained[request.name] = bool(request.retainOnDelete)
        return register(self, request)

    monkeypatch.setattr(mocks.MockMonitor, "RegisterResource", recording)
    deployment = deploy(VALID_CONFIG)
    kept = {r.type.rsplit(":", 1)[-1] for r in deployment.mocks.of_type("") if retained[r.name]}
    assert kept == {"ResourceGroup", "StorageAccount", "BlobContainer", "BlobServiceProperties"}
    data_group = by_name(deployment, ":ResourceGroup", "-data-rg")
    assert [r.name for r in deployment.mocks.of_type(":ResourceGroup") if retained[r.name]] == [data_group.name]
    assert sum(not keep for keep in retained.values()) > 20  # the cluster: everything else goes


# --- a new cluster writing its results to an account an earlier stack kept (keptResultsAccount) ----------


@pytest.fixture(scope="module")
def kept() -> Deployment:
    return deploy({**VALID_CONFIG, "keptResultsAccount": KEPT_ACCOUNT_ID})


def test_results_go_to_the_kept_account_through_a_private_endpoint(kept: Deployment) -> None:
    """The kept account's firewall admits only the deleted cluster's subnets, and the stack cannot change
    it: the cluster subnet reaches its blob service through a private endpoint, whose address a private
    DNS zone linked to the VNet gives the account's usual name."""
    endpoint = one(kept, ":PrivateEndpoint")
    cluster_subnet = by_name(kept, ":Subnet", "-cluster")
    assert endpoint.inputs["subnet"]["id"] == cluster_subnet.id
    (connection,) = endpoint.inputs["privateLinkServiceConnections"]
    assert connection["privateLinkServiceId"] == KEPT_ACCOUNT_ID and connection["groupIds"] == ["blob"]
    zone = one(kept, ":PrivateZone")
    assert zone.inputs["privateZoneName"] == "privatelink.blob.core.windows.net" and zone.inputs["location"] == "Global"
    link = one(kept, ":VirtualNetworkLink")
    assert link.inputs["virtualNetwork"] == {"id": one(kept, ":VirtualNetwork").id}
    # other accounts' private endpoints, with no record in this zone, still resolve (publicly) in the VNet
    assert link.inputs["resolutionPolicy"] == "NxDomainRedirect"
    assert link.inputs["privateZoneName"] == zone.outputs["name"] and link.inputs["registrationEnabled"] is False
    group = one(kept, ":PrivateDnsZoneGroup")
    assert group.inputs["privateEndpointName"] == endpoint.outputs["name"]
    assert group.inputs["privateDnsZoneConfigs"] == [{"name": "blob", "privateDnsZoneId": zone.id}]
    # the cluster's group holds them: they go with `pulumi destroy`, the kept account stays as it was
    cluster_group = kept.outputs["resource_group"].value
    assert {r.inputs["resourceGroupName"] for r in (endpoint, zone, link, group)} == {cluster_group}


def test_a_manual_approval_asks_the_accounts_owner_with_a_message_naming_the_stack() -> None:
    """Without the approval right on the kept account, an automatic connection is refused
    (LinkedAuthorizationFailed): keptResultsApproval manual sends a request for its owner to approve."""
    manual = deploy({**VALID_CONFIG, "keptResultsAccount": KEPT_ACCOUNT_ID, "keptResultsApproval": "manual"})
    endpoint = one(manual, ":PrivateEndpoint")
    assert "privateLinkServiceConnections" not in endpoint.inputs
    (request,) = endpoint.inputs["manualPrivateLinkServiceConnections"]
    assert request["privateLinkServiceId"] == KEPT_ACCOUNT_ID and request["groupIds"] == ["blob"]
    assert f"{PROJECT}/{STACK}" in request["requestMessage"] and len(request["requestMessage"]) <= 140


def test_the_nodes_and_the_operator_write_the_kept_results_container_only(kept: Deployment) -> None:
    container = f"{KEPT_ACCOUNT_ID}/blobServices/default/containers/results"
    storage_grants = {
        (r.inputs["principalId"], r.inputs["scope"])
        for r in kept.mocks.of_type(":RoleAssignment")
        if r.inputs["roleDefinitionId"].endswith(STORAGE_BLOB_DATA_CONTRIBUTOR)
    }
    nodes = by_name(kept, ":UserAssignedIdentity", "-cluster-").outputs["principalId"]
    tracking = by_name(kept, ":UserAssignedIdentity", "-mlflow-").outputs["principalId"]  # the runs' models
    own = {r.inputs["containerName"]: r.id for r in kept.mocks.of_type(":BlobContainer")}
    assert storage_grants == {
        (nodes, container),  # not the new, empty results container
        (tracking, container),
        (OPERATOR_OBJECT_ID, container),
        (OPERATOR_OBJECT_ID, own["data"]),
        (OPERATOR_OBJECT_ID, own["results"]),
    }


def test_the_description_points_results_at_the_kept_account(kept: Deployment, deployment: Deployment) -> None:
    outputs = {name: value.value for name, value in kept.outputs.items()}
    assert all(value.known for value in kept.outputs.values())
    assert outputs["results_blob_endpoint"] == "https://hvdsa5e6f7a8b.blob.core.windows.net/"
    assert outputs["blob_endpoint"] != outputs["results_blob_endpoint"]  # data stays in the new account
    # without the key: the stack's own account, and no endpoint or zone
    assert deployment.outputs["results_blob_endpoint"].value == deployment.outputs["blob_endpoint"].value
    assert not deployment.mocks.of_type(":PrivateEndpoint") and not deployment.mocks.of_type(":PrivateZone")
