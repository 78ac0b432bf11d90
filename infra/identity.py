"""The cluster's user-assigned identity and the least roles it needs, each at the narrowest scope."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import authorization, managedidentity

# Built-in role definition ids (the same in every tenant).
ACR_PULL = "7f951dda-4ed3-4680-a7ca-43fe172d538d"
STORAGE_BLOB_DATA_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"


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

    They read the dataset through the read-only SAS, so the identity has no right on `data`.
    """

    def __init__(self, name: str, args: ClusterIdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:ClusterIdentity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.identity = managedidentity.UserAssignedIdentity(
            f"{name}-id",
            resource_group_name=args.resource_group_name,
            location=args.location,
            tags=args.tags,
            opts=child,
        )
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
