"""One mock of Azure's control plane for every infrastructure test.

It echoes inputs as outputs, as the provider does, adds the computed outputs that the program
reads, and records each registered resource and each invoke so that tests assert on what was
sent to Azure rather than on Python objects. Secret inputs are recorded in the clear, with the
names of the properties that were sent as secrets.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi.runtime.mocks import MockMonitor
from pulumi.runtime.rpc import is_rpc_secret, unwrap_rpc_secret

SUBSCRIPTION = "00000000-0000-0000-0000-0000000000aa"
OPERATOR_OBJECT_ID = "00000000-0000-0000-0000-0000000000bb"
MOCK_SAS = "sv=2024-01-01&sr=c&sp=rl&spr=https&se=2099-01-01T00%3A00%3A00Z&sig=mock"
JUMPBOX_IP = "203.0.113.10"
LUSTRE_MGS = "10.40.192.5"  # what the mock Azure Managed Lustre reports as its management service's address
# What the mock random provider returns for the munge key: recognisable wherever it leaks.
MUNGE_KEY = base64.b64encode(b"MUNGE-TEST-KEY:" + bytes(range(256)) * 4).decode()
# ... and for slurmdbd's database password (letters and digits, as RandomPassword with special=False)
DATABASE_PASSWORD = "MockDatabasePassword4Slurmdbd0x"


@dataclass
class Registered:
    type: str  # e.g. "azure-native:network:Subnet"
    name: str  # logical name
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    id: str
    secret_inputs: frozenset[str]  # top-level properties sent as secrets (a secret anywhere inside marks its property)


class AzureMocks(pulumi.runtime.Mocks):
    def __init__(self) -> None:
        self.resources: list[Registered] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        # logical name -> the logical names of the resources it waits for (DependencyRecordingMonitor)
        self.dependencies: dict[str, frozenset[str]] = {}

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        secret = frozenset(key for key, value in args.inputs.items() if is_rpc_secret(value))
        inputs = {key: unwrap_rpc_secret(value) if key in secret else value for key, value in args.inputs.items()}
        outputs = dict(args.inputs)  # secrets stay secret in the echo, as with the provider
        outputs.setdefault("name", args.name)
        resource_id = _resource_id(args.typ, args.name, inputs)
        outputs.update(_computed(args.typ, args.name, inputs))
        self.resources.append(Registered(args.typ, args.name, inputs, outputs, resource_id, secret))
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

    def waits_for(self, name: str) -> set[str]:
        """Every resource that the engine creates before `name`: its dependencies, and theirs."""
        waited: set[str] = set()
        pending = set(self.dependencies.get(name, ()))
        while pending:
            dependency = pending.pop()
            waited.add(dependency)
            pending |= self.dependencies.get(dependency, frozenset()) - waited
        return waited


class DependencyRecordingMonitor(MockMonitor):
    """Pulumi's mock monitor, recording each resource's dependencies (its depends_on and the resources its
    inputs come from), which MockResourceArgs leaves out: the order in which the engine would create them."""

    def __init__(self, mocks: AzureMocks) -> None:
        super().__init__(mocks)
        self.azure = mocks

    def RegisterResource(self, request: Any) -> Any:
        self.azure.dependencies[request.name] = frozenset(urn.rsplit("::", 1)[-1] for urn in request.dependencies)
        return super().RegisterResource(request)


def _resource_id(typ: str, name: str, inputs: dict[str, Any]) -> str:
    """Azure's id for a scale set, which the program also computes from its names; a mock one for the rest."""
    if typ == "azure-native:compute:VirtualMachineScaleSet" and "vmScaleSetName" in inputs:
        return (
            f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{inputs['resourceGroupName']}"
            f"/providers/Microsoft.Compute/virtualMachineScaleSets/{inputs['vmScaleSetName']}"
        )
    return f"/subscriptions/{SUBSCRIPTION}/mock/{typ}/{name}"


def _computed(typ: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The outputs Azure (and the random provider) computes that the program reads."""
    if typ == "random:index/randomBytes:RandomBytes":
        return {"base64": MUNGE_KEY}
    if typ == "random:index/randomPassword:RandomPassword":
        return {"result": DATABASE_PASSWORD}
    if typ.endswith("managedidentity:UserAssignedIdentity"):
        return {"principalId": f"principal-{name}", "clientId": f"client-{name}"}
    if typ.endswith("containerregistry:Registry"):
        return {"loginServer": f"{name}.azurecr.io"}
    if typ.endswith("network:PublicIPAddress"):
        return {"ipAddress": JUMPBOX_IP}
    if typ.endswith("keyvault:Vault"):
        return {"properties": {**inputs["properties"], "vaultUri": f"https://{name}.vault.azure.net/"}}
    if typ.endswith("storage:StorageAccount"):
        return {"primaryEndpoints": {"blob": f"https://{name}.blob.core.windows.net/"}}
    if typ.endswith(("compute:VirtualMachine", "compute:VirtualMachineScaleSet")) and "identity" in inputs:
        # identity.userAssignedIdentities is a list of ids going in and a map coming out.
        identity = dict(inputs["identity"])
        identity["userAssignedIdentities"] = {i: {} for i in identity.get("userAssignedIdentities", [])}
        return {"identity": identity}
    if typ.endswith("storagecache:AmlFilesystem"):
        return {"clientInfo": {"mgsAddress": LUSTRE_MGS, "lustreVersion": "2.15.7"}}
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
