"""The Spot scale set under Pulumi mocks (resources built after set_mocks, preview=False, outputs known):
the same definition as the on-demand set, with Spot priority, and the head node powering both."""

from __future__ import annotations

import json
from typing import Any

import pulumi
import pytest
import yaml

from tests.infra.azure_mocks import AzureMocks, Registered
from tests.infra.conftest import VALID_CONFIG, Deployment, deploy
from tests.infra.documents import decode_custom_data
from tests.infra.test_stack import by_name, head_file, slurm_settings

SPOT_CONFIG = {
    **VALID_CONFIG,
    "spotNodeCount": "3",
    "spotEvictionPolicy": "Deallocate",
    "spotMaxPrice": "25.5",
    "defaultJobTime": "12:00:00",
    "maxJobTime": "3-00:00:00",
}
# What may differ between the on-demand and the Spot scale set: their names, their nodes' names, what
# makes them Spot, how many there are.
SPOT_ONLY = ("priority", "evictionPolicy", "billingProfile")


@pytest.fixture(scope="module")
def spot_deployment() -> Deployment:
    return deploy(SPOT_CONFIG)


def scale_sets(deployment: Deployment) -> tuple[Registered, Registered]:
    return by_name(deployment, ":VirtualMachineScaleSet", "-gpu-"), by_name(
        deployment, ":VirtualMachineScaleSet", "-spot-"
    )


def comparable(vmss: Registered) -> dict[str, Any]:
    """The scale set's inputs less its count, names and Spot settings; the custom data as its document."""
    inputs = json.loads(json.dumps(vmss.inputs))
    inputs["sku"].pop("capacity")
    inputs.pop("vmScaleSetName")
    profile = inputs["virtualMachineProfile"]
    for key in SPOT_ONLY:
        profile.pop(key, None)
    profile["osProfile"].pop("computerNamePrefix")
    profile["osProfile"]["customData"] = yaml.safe_load(decode_custom_data(profile["osProfile"]["customData"]))
    inputs.pop("proximityPlacementGroup")  # one per scale set (one placement group each), checked below
    return inputs


def test_the_spot_scale_set_is_spot_with_the_configured_eviction_and_price(spot_deployment: Deployment) -> None:
    on_demand, spot = scale_sets(spot_deployment)
    profile = spot.inputs["virtualMachineProfile"]
    assert profile["priority"] == "Spot"
    assert profile["evictionPolicy"] == "Deallocate"
    assert profile["billingProfile"] == {"maxPrice": 25.5}
    assert spot.inputs["sku"]["capacity"] == 3
    assert not set(SPOT_ONLY) & set(on_demand.inputs["virtualMachineProfile"])  # on demand stays on demand


def test_the_spot_scale_set_has_the_on_demand_sets_hardening(spot_deployment: Deployment) -> None:
    on_demand, spot = scale_sets(spot_deployment)
    assert comparable(spot) == comparable(on_demand)  # identity, image, disks, network, security, cloud-init
    for vmss in (on_demand, spot):
        nics = vmss.inputs["virtualMachineProfile"]["networkProfile"]["networkInterfaceConfigurations"]
        assert all("publicIPAddressConfiguration" not in c for nic in nics for c in nic["ipConfigurations"])
        assert vmss.inputs["virtualMachineProfile"]["osProfile"]["linuxConfiguration"]["disablePasswordAuthentication"]
        assert vmss.inputs["virtualMachineProfile"]["securityProfile"]["encryptionAtHost"] is True
    placement = {vmss.inputs["proximityPlacementGroup"]["id"] for vmss in (on_demand, spot)}
    assert len(placement) == 2  # each set its own fabric


def test_the_head_node_makes_a_spot_partition_and_powers_the_spot_nodes(spot_deployment: Deployment) -> None:
    _, spot = scale_sets(spot_deployment)
    lines = head_file(spot_deployment, "/etc/slurm/slurm.conf").splitlines()
    partitions = {line.split()[0]: line for line in lines if line.startswith("PartitionName=")}
    spot_nodes = "hvd-spot-000000,hvd-spot-000001,hvd-spot-000002"
    assert f"Nodes={spot_nodes} Default=NO PriorityTier=2" in partitions["PartitionName=spot"]
    assert (
        "Nodes=hvd-gpu-000000," in partitions["PartitionName=gpu"] and "Default=YES" in partitions["PartitionName=gpu"]
    )
    assert any(line.startswith(f"NodeName={spot_nodes} ") and "Gres=gpu:8" in line for line in lines)
    # the stack's job time limits on both partitions, and in its outputs for `cluster from-stack`
    assert all(" DefaultTime=12:00:00 MaxTime=3-00:00:00 " in line for line in partitions.values())
    times = [spot_deployment.outputs[key] for key in ("default_job_time", "max_job_time")]
    assert [(out.known, out.value) for out in times] == [(True, "12:00:00"), (True, "3-00:00:00")]
    assert "SuspendTime" in slurm_settings(spot_deployment)  # power saving for both kinds
    power = json.loads(head_file(spot_deployment, "/etc/slurm/azure-power.json"))
    spot_identity = by_name(spot_deployment, ":UserAssignedIdentity", "-spot-power")
    assert power["spot"] == {
        "scale_set_id": spot.id,
        "identity_client_id": spot_identity.outputs["clientId"],
        "node_prefix": "hvd-spot-",
    }
    # the identity holds its power role on the Spot scale set alone, and only the head node holds it
    assignment = by_name(spot_deployment, ":RoleAssignment", "-spot-power-assignment")
    assert assignment.inputs["scope"] == spot.id
    head = by_name(spot_deployment, ":VirtualMachine", "head")
    assert spot_identity.id in head.inputs["identity"]["userAssignedIdentities"]
    assert spot_deployment.outputs["spot_partition"].value == "spot"


def test_without_spot_nodes_there_is_no_spot_scale_set_nor_partition(deployment: Deployment) -> None:
    assert [r.name for r in deployment.mocks.of_type(":VirtualMachineScaleSet")] == ["hvd-gpu-vmss"]
    assert deployment.outputs["spot_partition"].value is None
    assert "PartitionName=spot" not in head_file(deployment, "/etc/slurm/slurm.conf")


# --- the head node first: no GPU VM runs without the reaper that deallocates it --------------------------


class SpotCapacityRefused(AzureMocks):
    """Azure refusing the Spot scale set (no Spot capacity or quota), after the rest was accepted."""

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        if args.typ.endswith(":VirtualMachineScaleSet") and "-spot-" in args.name:
            raise RuntimeError("SkuNotAvailable: no Spot capacity for Standard_ND96isr_H100_v5")
        return super().new_resource(args)


def test_the_head_node_waits_for_no_scale_set_and_every_scale_set_waits_for_it(spot_deployment: Deployment) -> None:
    mocks = spot_deployment.mocks
    head = by_name(spot_deployment, ":VirtualMachine", "head").name
    sets = {vmss.name for vmss in scale_sets(spot_deployment)}
    assert not mocks.waits_for(head) & sets  # ids and names computed, not read from the scale sets
    assert all(head in mocks.waits_for(vmss) for vmss in sets)


def test_a_refused_spot_scale_set_leaves_the_head_node_standing() -> None:
    mocks = SpotCapacityRefused()
    with pytest.raises(Exception, match="no Spot capacity"):
        deploy(SPOT_CONFIG, mocks)
    created = {r.name for r in mocks.of_type(":VirtualMachine") + mocks.of_type(":VirtualMachineScaleSet")}
    assert {"hvd-head-vm", "hvd-gpu-vmss"} <= created
