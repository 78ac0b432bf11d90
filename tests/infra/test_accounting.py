"""Slurm accounting on Azure, under Pulumi's mocks: slurmdbd's database on the head node's own data disk
(the default), or an existing Azure Database for MySQL Flexible Server reached privately over TLS; either
way its password is a Key Vault secret that only the head node reads, and no custom data carries it."""

from __future__ import annotations

import json
import stat
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pulumi
import pytest
import yaml

from infra.cloud_init._common import DATABASE_PASSWORD_SECRET
from infra.cloud_init.accounting import (
    ASSOCIATIONS_PATH,
    AZURE_MYSQL_CA_BUNDLE,
    AZURE_MYSQL_ROOTS,
    MARIADB_CONF_PATH,
    SLURMDBD_SETUP_PATH,
    SLURMDBD_TEMPLATE_PATH,
)
from infra.config import ConfigError, load_config
from infra.key_vault import KEY_VAULT_SECRETS_USER
from tests.infra.azure_mocks import DATABASE_PASSWORD, AzureMocks
from tests.infra.conftest import PROJECT, STACK, VALID_CONFIG, Deployment, deploy
from tests.infra.documents import HEAD_CLIENT_ID, accounting, files_of, head_doc, setup_packages
from tests.infra.sandbox import Sandbox, shell_value, with_value
from tests.infra.test_stack import by_name, custom_data, head_document
from tests.local_http import reply_json, serving

SERVER_ID = (
    "/subscriptions/00000000-0000-0000-0000-0000000000aa/resourceGroups/team-db"
    "/providers/Microsoft.DBforMySQL/flexibleServers/teamacct"
)
MYSQL_PASSWORD = "Team-Db-Passw0rd!"
MYSQL_CONFIG = {**VALID_CONFIG, "accountingMysqlServer": SERVER_ID, "accountingMysqlPassword": MYSQL_PASSWORD}


@pytest.fixture(scope="module")
def mysql() -> Deployment:
    return deploy(MYSQL_CONFIG)


def head_files(deployment: Deployment) -> dict[str, Any]:
    return {entry["path"]: entry for entry in yaml.safe_load(head_document(deployment))["write_files"]}


def settings(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def assert_password_only_in_its_secret(deployment: Deployment, password: str) -> None:
    """The password is the Key Vault secret's value, sent as a secret; no other input and no custom data
    holds it, and the head node's identity alone may read it."""
    secret = by_name(deployment, ":Secret", "database-password")
    assert secret.inputs["secretName"] == DATABASE_PASSWORD_SECRET
    assert secret.inputs["properties"]["value"] == password and "properties" in secret.secret_inputs
    for document in custom_data(deployment).values():
        assert password not in document
    others = [r.inputs for r in deployment.mocks.resources if r is not secret and "random" not in r.type]
    assert password not in json.dumps(others, default=str)
    readers = {
        r.inputs["principalId"]
        for r in deployment.mocks.of_type(":RoleAssignment")
        if r.inputs["scope"] == secret.id and r.inputs["roleDefinitionId"].endswith(KEY_VAULT_SECRETS_USER)
    }
    assert readers == {by_name(deployment, ":UserAssignedIdentity", "-head-").outputs["principalId"]}
    setup = head_files(deployment)[SLURMDBD_SETUP_PATH]["content"]
    vault = by_name(deployment, ":Vault", "kv").outputs["properties"]["vaultUri"]
    assert (shell_value(setup, "VAULT_URI"), shell_value(setup, "SECRET_NAME")) == (vault, DATABASE_PASSWORD_SECRET)


def test_by_default_mariadb_runs_on_the_head_nodes_own_data_disk(deployment: Deployment) -> None:
    disk = by_name(deployment, ":Disk", "db-disk")
    assert disk.inputs["creationData"] == {"createOption": "Empty"} and disk.inputs["diskSizeGB"] == 32
    assert disk.inputs["sku"] == {"name": "Premium_LRS"}
    assert (disk.inputs["networkAccessPolicy"], disk.inputs["publicNetworkAccess"]) == ("DenyAll", "Disabled")
    # attached at LUN 0 (database-disk.sh's /dev/disk/azure/scsi1/lun0), and kept when the VM goes
    (attached,) = by_name(deployment, ":VirtualMachine", "head").inputs["storageProfile"]["dataDisks"]
    assert attached == {
        "lun": 0,
        "createOption": "Attach",
        "managedDisk": {"id": disk.id},
        "caching": "ReadOnly",
        "deleteOption": "Detach",
    }
    files = head_files(deployment)
    conf = settings(files[SLURMDBD_TEMPLATE_PATH]["content"])
    assert (conf["StorageHost"], conf["StoragePort"], conf["StorageUser"]) == ("127.0.0.1", "3306", "slurm")
    assert "StoragePass" not in conf and "StorageParameters" not in conf  # the password is added at boot
    assert files[SLURMDBD_TEMPLATE_PATH]["permissions"] == "0600"
    mariadb = settings(files[MARIADB_CONF_PATH]["content"])
    assert mariadb["innodb_lock_wait_timeout"] == "900" and mariadb["max_allowed_packet"] == "16M"
    assert mariadb["loose-innodb_snapshot_isolation"] == "OFF" and mariadb["bind-address"] == "127.0.0.1"
    assert "mariadb-server" in setup_packages(head_document(deployment))
    assert any(p.startswith("slurm-smd-slurmdbd=") for p in setup_packages(head_document(deployment)))
    # the cluster, its default account, and the admin user who submits the jobs
    assert "User - 'hpcadmin':DefaultAccount='dtrain'\n" in files[ASSOCIATIONS_PATH]["content"]
    assert not deployment.mocks.of_type(":PrivateEndpoint")
    assert_password_only_in_its_secret(deployment, DATABASE_PASSWORD)


def test_a_mysql_flexible_server_is_reached_through_a_private_endpoint_over_tls(mysql: Deployment) -> None:
    endpoint = by_name(mysql, ":PrivateEndpoint", "accounting")
    (connection,) = endpoint.inputs["privateLinkServiceConnections"]
    assert (connection["privateLinkServiceId"], connection["groupIds"]) == (SERVER_ID, ["mysqlServer"])
    assert endpoint.inputs["subnet"]["id"] == by_name(mysql, ":Subnet", "-cluster").id  # the head node's subnet
    # the server's own name resolves to the endpoint inside the VNet: its certificate's name is the one asked for
    zone = by_name(mysql, ":PrivateZone", "accounting")
    assert zone.inputs["privateZoneName"] == "privatelink.mysql.database.azure.com"
    link = by_name(mysql, ":VirtualNetworkLink", "accounting")
    assert link.inputs["virtualNetwork"]["id"] == by_name(mysql, ":VirtualNetwork", "vnet").id
    assert link.inputs["registrationEnabled"] is False and link.inputs["resolutionPolicy"] == "NxDomainRedirect"
    group = by_name(mysql, ":PrivateDnsZoneGroup", "accounting")
    assert group.inputs["privateDnsZoneConfigs"] == [{"name": "mysql", "privateDnsZoneId": zone.id}]
    files = head_files(mysql)
    conf = settings(files[SLURMDBD_TEMPLATE_PATH]["content"])
    assert conf["StorageHost"] == "teamacct.mysql.database.azure.com" and conf["StorageUser"] == "slurmdbd"
    assert conf["StorageParameters"] == f"SSL_CA={AZURE_MYSQL_CA_BUNDLE}"
    setup = files[SLURMDBD_SETUP_PATH]["content"]
    assert shell_value(setup, "CA_SOURCES") == list(AZURE_MYSQL_ROOTS) and shell_value(setup, "LOCAL_DATABASE") == "0"
    # nothing of MariaDB's: no disk, no package, no settings; and nothing that opens the server to anyone
    assert not mysql.mocks.of_type(":Disk") and MARIADB_CONF_PATH not in files
    assert "mariadb-server" not in setup_packages(head_document(mysql))
    assert not [r for r in mysql.mocks.resources if "dbformysql" in r.type.lower() or "PublicIP" in r.name]
    assert_password_only_in_its_secret(mysql, MYSQL_PASSWORD)


def _load(raw: dict[str, object], secret_keys: list[str]) -> object:
    pulumi.runtime.set_mocks(AzureMocks(), project=PROJECT, stack=STACK, preview=False)
    pulumi.runtime.set_all_config(
        {f"{PROJECT}:{k}": json.dumps(v) if isinstance(v, dict) else str(v) for k, v in raw.items()},
        [f"{PROJECT}:{k}" for k in secret_keys],
    )
    try:
        return load_config()
    finally:
        pulumi.runtime.set_all_config({})


def test_the_mysql_password_is_a_secret_and_never_shown() -> None:
    assert _load(MYSQL_CONFIG, ["accountingMysqlPassword"]).accounting_mysql_server == SERVER_ID
    with pytest.raises(ConfigError, match="pulumi config set --secret accountingMysqlPassword") as plain:
        _load(MYSQL_CONFIG, [])
    bad = "bad pass#word 12345"
    with pytest.raises(ConfigError, match="accountingMysqlPassword: got a secret") as refused:
        _load({**MYSQL_CONFIG, "accountingMysqlPassword": bad}, ["accountingMysqlPassword"])
    assert MYSQL_PASSWORD not in str(plain.value) and bad not in str(refused.value)
    with pytest.raises(ConfigError, match=r"accountingMysqlServer: .*needs accountingMysqlPassword"):
        _load({**VALID_CONFIG, "accountingMysqlServer": SERVER_ID}, [])


TOKEN = "imds-token-for-the-head"


class Vault(BaseHTTPRequestHandler):
    """IMDS and Key Vault in one: a token for vault.azure.net to the head node's identity, the password for it."""

    password = ""

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/metadata/identity/oauth2/token" and query["client_id"] == [HEAD_CLIENT_ID]:
            reply_json(self, 200, {"access_token": TOKEN})
        elif url.path == f"/secrets/{DATABASE_PASSWORD_SECRET}" and self.headers["Authorization"] == f"Bearer {TOKEN}":
            reply_json(self, 200, {"value": Vault.password})
        else:
            reply_json(self, 403, {"error": {"code": "Forbidden"}})

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("mysql", [False, True], ids=["mariadb", "mysql"])
def test_slurmdbd_setup_puts_the_password_only_where_it_belongs(sandbox: Sandbox, mysql: bool) -> None:
    """The password from Key Vault with the head node's identity goes into slurmdbd.conf (0600, slurm's) and,
    with MariaDB on the node, into the grant's SQL on MariaDB's stdin: never into argv or the log. With a MySQL
    Flexible Server, the CA bundle is the three Azure roots from the trust store. Then slurmdbd restarts and
    the associations load."""
    Vault.password = "Sandbox-Passw0rd!"
    document = head_doc(accounting=accounting(mysql=mysql))
    files = files_of(document)
    roots = []
    for index, root in enumerate(AZURE_MYSQL_ROOTS):  # stand-ins for the trust store's files
        roots.append(sandbox.root / Path(root).name)
        roots[-1].write_text(f"-----BEGIN CERTIFICATE-----\nroot {index}\n-----END CERTIFICATE-----\n")
    paths = {"TEMPLATE": SLURMDBD_TEMPLATE_PATH, "ASSOCIATIONS": ASSOCIATIONS_PATH}
    with serving(Vault) as endpoint:
        script = with_value(str(files[SLURMDBD_SETUP_PATH]["content"]), "VAULT_URI", endpoint)
        for name, path in paths.items():
            (sandbox.root / name).write_text(str(files[path]["content"]))
            script = with_value(script, name, str(sandbox.root / name))
        conf, bundle = sandbox.root / "slurmdbd.conf", sandbox.root / "ca.pem"
        script = with_value(script, "CONF", str(conf))
        script = with_value(script, "MEMORY_CONF", str(sandbox.root / "memory.cnf"))
        if mysql:
            script = with_value(script, "CA_BUNDLE", str(bundle))
            script = with_value(script, "CA_SOURCES", [str(root) for root in roots])
        for name in ("chown", "systemctl", "sacctmgr"):
            sandbox.stub(name)
        sandbox.stub("mariadb", 'cat >"$STUB_STATE/sql"')
        sandbox.stub("curl", 'echo "curl $*" >>"$STUB_STATE/argv"; exec /usr/bin/curl "$@"')
        result = sandbox.run(script, {"IMDS_ENDPOINT": f"{endpoint}/metadata/identity/oauth2/token"})
    assert result.returncode == 0, result.stderr
    written = conf.read_text()
    assert written == str(files[SLURMDBD_TEMPLATE_PATH]["content"]) + f"StoragePass={Vault.password}\n"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and sandbox.calls("chown")[-1].startswith("chown slurm:slurm ")
    said = sandbox.log.read_text() + (sandbox.state / "argv").read_text() + result.stdout + result.stderr
    assert Vault.password not in said and TOKEN not in said
    assert sandbox.calls("systemctl")[-2:] == ["systemctl enable slurmdbd", "systemctl restart slurmdbd"]
    assert sandbox.calls("sacctmgr") == [f"sacctmgr --immediate load {sandbox.root / 'ASSOCIATIONS'}"]
    if mysql:
        assert bundle.read_text() == "".join(root.read_text() for root in roots) and not sandbox.calls("mariadb")
    else:
        sql = (sandbox.state / "sql").read_text()
        assert (
            f"IDENTIFIED BY '{Vault.password}'" in sql and "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'" in sql
        )
        memory = settings((sandbox.root / "memory.cnf").read_text())
        assert int(memory["innodb_buffer_pool_size"].rstrip("M")) >= 1 and not bundle.exists()
        assert sandbox.calls("systemctl")[:2] == ["systemctl enable mariadb", "systemctl restart mariadb"]
