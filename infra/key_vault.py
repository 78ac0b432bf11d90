"""The Key Vault that hands the cluster's munge key to the head node and the GPU nodes at boot, and
slurmdbd's database password to the head node.

Azure's guidance is that VM custom data is not for secrets (anyone who can read the VM's model, and
every process on the VM through IMDS, can read it back). So the key lives here, as a secret, and
each machine fetches it at first boot with its own managed identity (dtrain/remote/boot/munge-key.sh;
the password: slurmdbd-setup.sh). RBAC authorization: only the identities that run Slurm may read
secrets, each only the secrets it needs (role assigned at each secret's scope: the database password
is the head node's alone). The firewall denies by default and admits the cluster subnet only (its
service endpoint), where the head node and the nodes live; the operator never needs either.
`pulumi up` writes the secrets through Azure Resource Manager, which the firewall and the data-plane
roles do not govern.

Public network access stays "Enabled" with that firewall: "Disabled" overrides the firewall's
rules, service endpoints included, and would leave the hosts only a private endpoint, which this
stack does not make (docs/infrastructure.md, "Key Vault"). Soft delete is on (Azure no longer lets
it be off) and purge protection is on unless keyVaultPurgeProtection is false. Each secret has a
content type and an expiry that every `pulumi up` moves forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pulumi
from pulumi_azure_native import authorization, keyvault

from infra.cloud_init._common import DATABASE_PASSWORD_SECRET, MUNGE_KEY_SECRET
from infra.identity import grant, role_definition_id

# Built-in role: read secret contents, nothing else (not list, not set, not keys or certificates).
KEY_VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"
# The shortest retention Azure allows: a deleted vault (and its name) can be recovered this long.
SOFT_DELETE_RETENTION_DAYS = 7
# What the secret holds, for whoever lists it: the base64 text of the key's bytes (munge-key.sh decodes it).
MUNGE_KEY_CONTENT_TYPE = "application/octet-stream; base64; munge key"
DATABASE_PASSWORD_CONTENT_TYPE = "text/plain; slurmdbd database password"
# How far ahead of each `pulumi up` a secret expires. Azure's documentation says an expired secret
# should not be retrieved, so a stack left without an update for this long could one day find its
# nodes unable to read the key at boot; a year leaves room for that, and any `pulumi up` renews it.
MUNGE_KEY_LIFETIME = timedelta(days=365)


def munge_key_expiry(now: datetime) -> int:
    """The secret's expiry, in seconds since the epoch as Key Vault takes it: MUNGE_KEY_LIFETIME from
    the start of today (UTC), so that several `pulumi up` on one day change nothing."""
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return int((today + MUNGE_KEY_LIFETIME).timestamp())


@dataclass
class SlurmKeyVaultArgs:
    resource_group_name: pulumi.Input[str]
    location: str
    cluster_subnet_id: pulumi.Input[str]  # needs the Microsoft.KeyVault service endpoint
    munge_key: pulumi.Input[str]  # base64, secret
    database_password: pulumi.Input[str]  # slurmdbd's (infra/accounting.py), secret
    tags: Mapping[str, str]
    # Azure refuses `false` once it is on, and a vault with it can only be left to expire: see
    # docs/infrastructure.md on redeploying a stack. Off: the property is not sent at all.
    purge_protection: bool = True


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
                enable_soft_delete=True,
                soft_delete_retention_in_days=SOFT_DELETE_RETENTION_DAYS,
                # Azure takes only `true`; absent is off (it refuses `false` on create and on update).
                enable_purge_protection=True if args.purge_protection else None,
                # "Disabled" would override the firewall below and cut the hosts off (no private endpoint)
                public_network_access="Enabled",
                network_acls=keyvault.NetworkRuleSetArgs(
                    default_action="Deny",
                    bypass="None",  # no "trusted Azure service" needs this key; ARM writes it regardless
                    virtual_network_rules=[keyvault.VirtualNetworkRuleArgs(id=args.cluster_subnet_id)],
                ),
            ),
            tags=args.tags,
            opts=child,
        )
        self.secret = self._secret(f"{name}-munge-key", MUNGE_KEY_SECRET, args.munge_key, MUNGE_KEY_CONTENT_TYPE, args)
        self.database_password = self._secret(
            f"{name}-database-password",
            DATABASE_PASSWORD_SECRET,
            args.database_password,
            DATABASE_PASSWORD_CONTENT_TYPE,
            args,
        )
        self._name = name
        self._reader_role = role_definition_id(client.subscription_id, KEY_VAULT_SECRETS_USER)
        self.role_assignments: list[authorization.RoleAssignment] = []
        self.vault_uri: pulumi.Output[str] = self.vault.properties.apply(lambda p: p.vault_uri)
        self.register_outputs({"vault_uri": self.vault_uri, "secret_name": MUNGE_KEY_SECRET})

    def _secret(
        self, name: str, secret_name: str, value: pulumi.Input[str], content_type: str, args: SlurmKeyVaultArgs
    ) -> keyvault.Secret:
        return keyvault.Secret(
            name,
            resource_group_name=args.resource_group_name,
            vault_name=self.vault.name,
            secret_name=secret_name,
            properties=keyvault.SecretPropertiesArgs(
                value=pulumi.Output.secret(value),
                content_type=content_type,
                attributes=keyvault.SecretAttributesArgs(enabled=True, expires=munge_key_expiry(datetime.now(UTC))),
            ),
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )

    def grant_read(self, what: str, principal_id: pulumi.Input[str], secret: keyvault.Secret | None = None) -> None:
        """Let one identity read one secret (Key Vault Secrets User on that secret alone; the munge key
        unless another is named). A method, not an argument: the head node's identity is made after the
        scale set, which needs vault_uri."""
        secret = secret or self.secret
        kind = "munge-key" if secret is self.secret else "database-password"
        self.role_assignments.append(
            grant(f"{self._name}-{kind}-{what}", principal_id, self._reader_role, secret.id, self, "ServicePrincipal")
        )
