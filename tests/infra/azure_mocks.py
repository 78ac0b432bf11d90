"""One mock of Azure's control plane for every infrastructure test.

It echoes inputs as outputs, as the provider does, adds the computed outputs that the program
reads, and records each registered resource and each invoke so that tests assert on what was
sent to Azure rather than on Python objects.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pulumi

SUBSCRIPTION = "00000000-0000-0000-0000-0000000000aa"
OPERATOR_OBJECT_ID = "00000000-0000-0000-0000-0000000000bb"
MOCK_SAS = "sv=2024-01-01&sr=c&sp=rl&spr=https&se=2099-01-01T00%3A00%3A00Z&sig=mock"
JUMPBOX_IP = "203.0.113.10"


@dataclass
class Registered:
    type: str  # e.g. "azure-native:network:Subnet"
    name: str  # logical name
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    id: str


class AzureMocks(pulumi.runtime.Mocks):
    def __init__(self) -> None:
        self.resources: list[Registered] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        outputs = dict(args.inputs)
        outputs.setdefault("name", args.name)
        resource_id = f"/subscriptions/{SUBSCRIPTION}/mock/{args.typ}/{args.name}"
        outputs.update(_computed(args.typ, args.name, args.inputs))
        self.resources.append(Registered(args.typ, args.name, dict(args.inputs), outputs, resource_id))
        return resource_id, outputs

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:
        # A bare dict: the tuple form's `None` failures list is iterated by the runtime and fails.
        self.calls.append((args.token, dict(args.args)))
        if args.token == "azure-native:authorization:getClientConfig":
            return {
                "subscriptionId": SUBSCRIPTION,
                "tenantId": "00000000-0000-0000-0000-0000000000cc",
                "objectId": OPERATOR_OBJECT_ID,
                "clientId": "00000000-0000-0000-0000-0000000000dd",
            }
        if args.token == "azure-native:storage:listStorageAccountServiceSAS":
            return {"serviceSasToken": MOCK_SAS}
        raise NotImplementedError(f"no mock for invoke {args.token}")

    def of_type(self, suffix: str) -> list[Registered]:
        """Resources whose type ends with e.g. ':Subnet' (custom resources only)."""
        return [r for r in self.resources if r.type.startswith("azure-native:") and r.type.endswith(suffix)]


def _computed(typ: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The outputs Azure computes that the program reads."""
    if typ.endswith("managedidentity:UserAssignedIdentity"):
        return {"principalId": f"principal-{name}", "clientId": f"client-{name}"}
    if typ.endswith("containerregistry:Registry"):
        return {"loginServer": f"{name}.azurecr.io"}
    if typ.endswith("network:PublicIPAddress"):
        return {"ipAddress": JUMPBOX_IP}
    if typ.endswith("storage:StorageAccount"):
        return {"primaryEndpoints": {"blob": f"https://{name}.blob.core.windows.net/"}}
    if typ.endswith(("compute:VirtualMachine", "compute:VirtualMachineScaleSet")) and "identity" in inputs:
        # identity.userAssignedIdentities is a list of ids going in and a map coming out.
        identity = dict(inputs["identity"])
        identity["userAssignedIdentities"] = {i: {} for i in identity.get("userAssignedIdentities", [])}
        return {"identity": identity}
    if typ.endswith("network:NetworkInterface"):
        configs = [dict(c) for c in inputs.get("ipConfigurations", [])]
        for config in configs:
            config.setdefault("privateIPAddress", "10.40.192.4")
        return {"ipConfigurations": configs}
    return {}


@dataclass
class Resolved:
    value: Any
    known: bool
    secret: bool


def resolve(outputs: dict[str, pulumi.Input[Any]]) -> dict[str, Resolved]:
    """Wait for every output and report its value, whether it is known, whether it is secret.

    Must run inside a `pulumi.runtime.test` function's event loop; returns an Output.
    """

    async def gather() -> dict[str, Resolved]:
        resolved = {}
        for key, value in outputs.items():
            output = pulumi.Output.from_input(value)
            known, secret = await asyncio.gather(output.is_known(), output.is_secret())
            resolved[key] = Resolved(await output.future(), known, secret)
        return resolved

    return pulumi.Output.from_input(asyncio.ensure_future(gather()))
