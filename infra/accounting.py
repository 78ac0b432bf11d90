"""Where slurmdbd keeps the cluster's accounting records, and the password it logs in with.

Two choices (docs/operator.md, "Accounting"):
  * MariaDB on the head node (the default), on the head node's own data disk (infra/head.py): the stack
    makes a random password for slurmdbd's database user;
  * an existing Azure Database for MySQL Flexible Server (accountingMysqlServer), which outlives any one
    cluster and may serve several: reached through a private endpoint in the cluster subnet, with the
    private DNS zone that makes the server's own name resolve to it inside the VNet (Azure's
    privatelink.mysql.database.azure.com), over TLS checked against Azure's roots
    (StorageParameters=SSL_CA=...), as cyclecloud-slurm reaches one. The stack cannot change a server it
    does not own: its owner keeps public network access off, and the endpoint is the way in.
Either way the password goes into the stack's Key Vault (infra/key_vault.py), which the head node reads at
boot with its identity: it is never in custom data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_random as random
from pulumi_azure_native import network

from infra.cloud_init.accounting import AZURE_MYSQL_CA_BUNDLE, LOOPBACK, AccountingDatabase
from infra.private_link import private_link

# Azure's zone for the private endpoints of MySQL Flexible Servers (public cloud), and their names' suffix.
MYSQL_PRIVATE_ZONE = "privatelink.mysql.database.azure.com"
MYSQL_SUFFIX = "mysql.database.azure.com"
MYSQL_GROUP_ID = "mysqlServer"  # the private link sub-resource of a Flexible Server
PASSWORD_LENGTH = 32  # letters and digits: what slurmdbd.conf and SQL carry without quoting


def mysql_host(server_id: str) -> str:
    """The server's name, as the VNet resolves it to the private endpoint (and TLS checks it)."""
    return f"{server_id.rsplit('/', 1)[1]}.{MYSQL_SUFFIX}"


@dataclass
class SlurmAccountingArgs:
    resource_group_name: pulumi.Input[str]  # the cluster's group: the endpoint goes with the cluster
    location: str
    vnet_id: pulumi.Input[str]
    subnet_id: pulumi.Input[str]  # the cluster subnet, where the head node is
    tags: Mapping[str, str]
    mysql_server_id: str | None = None  # None: MariaDB on the head node
    mysql_user: str = "slurmdbd"
    mysql_password: pulumi.Input[str] | None = None  # secret; with mysql_server_id


class SlurmAccounting(pulumi.ComponentResource):
    """The database slurmdbd writes to (database: its address, login and CA) and its password (a secret
    output); with a MySQL Flexible Server, the private endpoint and DNS zone that reach it."""

    def __init__(self, name: str, args: SlurmAccountingArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("hvd:infra:SlurmAccounting", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.database: AccountingDatabase
        if args.mysql_server_id is None:
            self.database = AccountingDatabase(host=LOOPBACK)
            generated = random.RandomPassword(f"{name}-password", length=PASSWORD_LENGTH, special=False, opts=child)
            self.password: pulumi.Output[str] = pulumi.Output.secret(generated.result)
        else:
            if args.mysql_password is None:
                raise ValueError("mysql_password: an existing server's login needs its password")
            self.database = AccountingDatabase(
                host=mysql_host(args.mysql_server_id), user=args.mysql_user, ssl_ca=AZURE_MYSQL_CA_BUNDLE
            )
            self.password = pulumi.Output.secret(args.mysql_password)
            self._private_access(name, args)
        self.register_outputs({"host": self.database.host})

    def _private_access(self, name: str, args: SlurmAccountingArgs) -> None:
        """A private endpoint from the cluster subnet to the server, and the zone that holds its address."""
        assert args.mysql_server_id is not None
        connection = network.PrivateLinkServiceConnectionArgs(
            name="slurm-accounting-mysql", private_link_service_id=args.mysql_server_id, group_ids=[MYSQL_GROUP_ID]
        )
        connections = {"private_link_service_connections": [connection]}
        reached = private_link(
            name, args, zone=MYSQL_PRIVATE_ZONE, zone_config="mysql", connections=connections, parent=self
        )
        self.endpoint = reached.endpoint
