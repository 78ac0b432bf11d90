"""The data that outlives `pulumi destroy` (Pulumi mocks): storage in a resource group of its own, with
blob soft delete and versioning, that no cluster resource lives in."""

from __future__ import annotations

from infra.storage import SOFT_DELETE_DAYS
from tests.infra.conftest import Deployment
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
