"""The data that outlives `pulumi destroy` (Pulumi mocks): storage in a resource group of its own, retained on
delete while the cluster is not, with blob soft delete and versioning, and no cluster resource in it."""

from __future__ import annotations

from typing import Any

import pytest
from pulumi.runtime import mocks

from infra.storage import SOFT_DELETE_DAYS
from tests.infra.conftest import VALID_CONFIG, Deployment, deploy
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
