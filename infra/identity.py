"""The cluster's user-assigned identity and the least roles it needs, each at the narrowest scope."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import authorization, managedidentity

# Built-in role definition ids (the same in every tenant).
ACR_PULL = "7f951dda-4ed3-4680-a7ca-43fe172d538d"
STORAGE_BLOB_DATA_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
# What Slurm's power programs do to the scale set (dtrain/remote/slurm/slurm_power.py), and
# nothing else: start and deallocate instances, and read an instance's view to say why one did not
# come up. Not delete, not scale, not reimage, not run commands on the nodes.
SCALE_SET_POWER_ACTIONS = (
    "Microsoft.Compute/virtualMachineScaleSets/start/action",
    "Microsoft.Compute/virtualMachineScaleSets/deallocate/action",
    "Microsoft.Compute/virtualMachineScaleSets/virtualMachines/instanceView/read",
)


@dataclass
class ClusterIdentityArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    registry_id: pulumi.Input[str]
    results_container_id: pulumi.Input[str]
    tags: Mapping[str, str]


def role_definition_id(subscription_id: pulumi.Input[str], role: str) -> pulumi.Output[str]:
    return pulumi.Output.concat(
        "/subscriptions/", subscription_id, "/providers/Microsoft.Authorization/roleDefinitions/", role
    )


def user_assigned_identity(
    name: str,
    resource_group_name: pulumi.Input[str],
    location: str,
    tags: Mapping[str, str],
    parent: pulumi.Resource,
) -> managedidentity.UserAssignedIdentity:
    return managedidentity.UserAssignedIdentity(
        f"{name}-id",
        resource_group_name=resource_group_name,
        location=location,
        tags=tags,
        opts=pulumi.ResourceOptions(parent=parent),
    )


def grant(
    name: str,
    principal_id: pulumi.Input[str],
    role_definition: pulumi.Input[str],
    scope: pulumi.Input[str],
    parent: pulumi.Resource,
    principal_type: str | None = None,
) -> authorization.RoleAssignment:
    return authorization.RoleAssignment(
        name,
        principal_id=principal_id,
        principal_type=principal_type,
        role_definition_id=role_definition,
        scope=scope,
        opts=pulumi.ResourceOptions(parent=parent),
    )


class ClusterIdentity(pulumi.ComponentResource):
    """Nodes pull images (AcrPull on the registry) and write results (on `results` only).

    Each job uploads its logs, metrics and run.json from the nodes when it ends, with an IMDS token
    of this identity for https://storage.azure.com/ (dtrain/remote/job/upload_results.py); its client
    id is the stack output cluster_identity_client_id. Storage Blob Data Contributor on the one
    container is the narrowest built-in role that creates and writes blobs. The nodes read the
    dataset through the read-only SAS, so the identity has no right on `data`.
    """

    def __init__(self, name: str, args: ClusterIdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:ClusterIdentity", name, None, opts)
        self.identity = user_assigned_identity(name, args.resource_group_name, args.location, args.tags, self)
        subscription_id = authorization.get_client_config_output().subscription_id
        grants = {
            "acr-pull": (ACR_PULL, args.registry_id),
            "results-writer": (STORAGE_BLOB_DATA_CONTRIBUTOR, args.results_container_id),
        }
        self.role_assignments = [
            # Without the type, a brand-new identity can fail on directory replication lag.
            grant(
                f"{name}-{what}",
                self.identity.principal_id,
                role_definition_id(subscription_id, role),
                scope,
                self,
                "ServicePrincipal",
            )
            for what, (role, scope) in grants.items()
        ]
        self.register_outputs(
            {
                "id": self.identity.id,
                "client_id": self.identity.client_id,
                "principal_id": self.identity.principal_id,
            }
        )


@dataclass
class OperatorAccessArgs:
    container_ids: Mapping[str, pulumi.Input[str]]  # container name -> resource id


class OperatorAccess(pulumi.ComponentResource):
    """The principal that runs `pulumi up` stages data and reads results with its own Entra ID
    login, so it gets blob data rights on the two containers and nothing account-wide."""

    def __init__(self, name: str, args: OperatorAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:OperatorAccess", name, None, opts)
        client = authorization.get_client_config_output()
        contributor = role_definition_id(client.subscription_id, STORAGE_BLOB_DATA_CONTRIBUTOR)
        self.role_assignments = [
            grant(f"{name}-{container}", client.object_id, contributor, scope, self)
            for container, scope in args.container_ids.items()
        ]
        self.register_outputs({})


@dataclass
class ScaleSetPowerIdentityArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    scale_set_name: str  # the scale set it powers, which need not exist yet
    tags: Mapping[str, str]


def scale_set_resource_id(
    subscription_id: pulumi.Input[str], resource_group_name: pulumi.Input[str], scale_set_name: str
) -> pulumi.Output[str]:
    """A scale set's ARM id, from its names: known before the scale set is created."""
    return pulumi.Output.concat(
        "/subscriptions/",
        subscription_id,
        "/resourceGroups/",
        resource_group_name,
        "/providers/Microsoft.Compute/virtualMachineScaleSets/",
        scale_set_name,
    )


class ScaleSetPowerIdentity(pulumi.ComponentResource):
    """The head node's identity for one scale set: a custom role with SCALE_SET_POWER_ACTIONS, assignable
    on that scale set only, and its assignment there. Whoever holds it can power that scale set's nodes
    and touch nothing else. (Azure discourages resource-level assignable scopes because custom roles
    count against a tenant limit of 5000; one per scale set is the price of a role no wider.)

    The identity, and the scale set's id (scale_set_id), come before the scale set: the head node that
    holds them is created first. The role, defined and assigned on the scale set itself, comes after it
    (grant_power).
    """

    def __init__(self, name: str, args: ScaleSetPowerIdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:ScaleSetPowerIdentity", name, None, opts)
        self._name = name
        self.identity = user_assigned_identity(name, args.resource_group_name, args.location, args.tags, self)
        self._subscription_id = authorization.get_client_config_output().subscription_id
        self.scale_set_id = scale_set_resource_id(self._subscription_id, args.resource_group_name, args.scale_set_name)
        self.register_outputs(
            {"id": self.identity.id, "client_id": self.identity.client_id, "scale_set_id": self.scale_set_id}
        )

    def grant_power(self, scale_set_id: pulumi.Input[str]) -> None:
        """The role and its assignment, on the scale set: pass its id output, so that they wait for it."""
        role = authorization.RoleDefinition(
            f"{self._name}-role",
            scope=scale_set_id,
            assignable_scopes=[scale_set_id],
            # Custom role names must be unique in the tenant; the scale set's id is.
            role_name=pulumi.Output.concat("Slurm power control for ", scale_set_id),
            description="Start and deallocate the instances of one VM scale set (Slurm power saving).",
            role_type="CustomRole",
            permissions=[authorization.PermissionArgs(actions=list(SCALE_SET_POWER_ACTIONS))],
            opts=pulumi.ResourceOptions(parent=self),
        )
        grant(
            f"{self._name}-assignment",
            self.identity.principal_id,
            # The definition's name is its GUID; assignments take the subscription-level id.
            role_definition_id(self._subscription_id, role.name),
            scale_set_id,
            self,
            "ServicePrincipal",
        )
