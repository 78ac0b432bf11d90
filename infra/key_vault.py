"""The Key Vault that hands the cluster's munge key to the head node and the GPU nodes at boot.

Azure's guidance is that VM custom data is not for secrets (anyone who can read the VM's model, and
every process on the VM through IMDS, can read it back). So the key lives here, as a secret, and
each machine fetches it at first boot with its own managed identity (dtrain/remote/boot/munge-key.sh).
RBAC authorization: only the two identities that run Slurm may read secrets, and only this one
secret (role assigned at the secret's scope). The firewall denies by default and admits the cluster
subnet only (its service endpoint), where the head node and the nodes live; the operator never
needs the key. `pulumi up` writes the secret through Azure Resource Manager, which the firewall and
the data-plane roles do not govern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import authorization, keyvault

from infra.cloud_init._common import MUNGE_KEY_SECRET
from infra.identity import grant, role_definition_id

# Built-in role: read secret contents, nothing else (not list, not set, not keys or certificates).
KEY_VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"
# The shortest retention Azure allows: a deleted vault's name is held this long.
SOFT_DELETE_RETENTION_DAYS = 7


@dataclass
class SlurmKeyVaultArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    cluster_subnet_id: pulumi.Input[str]  # needs the Microsoft.KeyVault service endpoint
    munge_key: pulumi.Input[str]  # base64, secret
    tags: Mapping[str, str]


class SlurmKeyVault(pulumi.ComponentResource):
    def __init__(self, name: str, args: SlurmKeyVaultArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:SlurmKeyVault", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        client = authorization.get_client_config_output()
        self.vault = keyvault.Vault(
            f"{name}kv",  # auto-named with a random suffix: vault names are global (3-24 characters)
            resource_group_name=args.resource_group_name,
            location=args.location,
            properties=keyvault.VaultPropertiesArgs(
                tenant_id=client.tenant_id,
                sku=keyvault.SkuArgs(family="A", name="standard"),
                enable_rbac_authorization=True,
                soft_delete_retention_in_days=SOFT_DELETE_RETENTION_DAYS,
                network_acls=keyvault.NetworkRuleSetArgs(
                    default_action="Deny",
                    bypass="None",  # no "trusted Azure service" needs this key
                    virtual_network_rules=[keyvault.VirtualNetworkRuleArgs(id=args.cluster_subnet_id)],
                ),
            ),
            tags=args.tags,
            opts=child,
        )
        self.secret = keyvault.Secret(
            f"{name}-munge-key",
            resource_group_name=args.resource_group_name,
            vault_name=self.vault.name,
            secret_name=MUNGE_KEY_SECRET,
            properties=keyvault.SecretPropertiesArgs(value=pulumi.Output.secret(args.munge_key)),
            tags=args.tags,
            opts=child,
        )
        self._name = name
        self._reader_role = role_definition_id(client.subscription_id, KEY_VAULT_SECRETS_USER)
        self.role_assignments: list[authorization.RoleAssignment] = []
        self.vault_uri: pulumi.Output[str] = self.vault.properties.apply(lambda p: p.vault_uri)
        self.register_outputs({"vault_uri": self.vault_uri, "secret_name": MUNGE_KEY_SECRET})

    def grant_read(self, what: str, principal_id: pulumi.Input[str]) -> None:
        """Let one identity read the munge key (Key Vault Secrets User on that secret alone). A method,
        not an argument: the head node's identity is made after the scale set, which needs vault_uri."""
        self.role_assignments.append(
            grant(
                f"{self._name}-munge-key-{what}",
                principal_id,
                self._reader_role,
                self.secret.id,
                self,
                "ServicePrincipal",
            )
        )
