"""Slurm's accounting: slurmdbd.conf, the MariaDB settings, and the cluster's associations, rendered by
pure functions from plain values, for any cluster (Azure's head node and the local one).

slurmctld sends every job's record to slurmdbd, which keeps them in MySQL or MariaDB: `sacct` reads them
back long after slurmctld has forgotten the job, with the TRES each job was allocated (gres/gpu among
them: slurm.conf's AccountingStorageTRES). The database is either MariaDB beside slurmdbd (on the head
node's own data disk; the local cluster's head namespace), reached over the loopback address, or an
Azure Database for MySQL Flexible Server reached over TLS through a private endpoint (infra/accounting.py).

No password here: slurmdbd.conf is rendered without StoragePass, which the head node appends at boot
from Key Vault (dtrain/remote/boot/slurmdbd-setup.sh) and the local cluster from its own file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infra.cloud_init._common import (
    DATABASE_PASSWORD_SECRET,
    check_client_id,
    check_hostname,
    check_int,
    check_ipv4,
    check_path,
    check_user,
    check_vault_uri,
    render_script,
    write_file,
)
from infra.cloud_init.slurm import check_name

# The database slurmdbd keeps its tables in, and the user it logs in as (slurmdbd.conf StorageLoc, StorageUser).
STORAGE_LOC = "slurm_acct_db"
STORAGE_USER = "slurm"
MYSQL_PORT = 3306
# Where MariaDB beside slurmdbd listens: the loopback address only (TLS on localhost is not needed).
LOOPBACK = "127.0.0.1"
# The account every job is charged to unless it names another: the cluster's default account, under
# Slurm's root account; the users who submit jobs are its members.
DEFAULT_ACCOUNT = "dtrain"
# Slurm's own advice for the database server (accounting.html, "MySQL Configuration"; slurmdbd logs an
# error at start for each value below its check). The buffer pool is the server's working set: Slurm
# asks for 5-50% of the server's memory and at least 4 GiB; the head node gives it its share below.
MIN_BUFFER_POOL_MB = 4096
MEMORY_SHARE = 4  # the head node gives its buffer pool a quarter of its memory
LOCK_WAIT_TIMEOUT_S = 900  # long rollups and purges must not fail on a lock held by another
MAX_ALLOWED_PACKET_MB = 16  # a job record with its script and environment fits in one packet
MARIADB_MEMORY_CONF_PATH = "/etc/mysql/mariadb.conf.d/61-slurmdbd-memory.cnf"  # sized at boot
# Where the head node keeps what it runs slurmdbd with.
SLURMDBD_CONF_PATH = "/etc/slurm/slurmdbd.conf"  # the rendered file and StoragePass (slurm's, 0600), made at boot
SLURMDBD_TEMPLATE_PATH = "/etc/slurm/slurmdbd.conf.in"  # the rendered file (root's, 0600)
ASSOCIATIONS_PATH = "/etc/slurm/associations.cfg"
SLURMDBD_LOG_PATH = "/var/log/slurm/slurmdbd.log"
SLURMDBD_PID_PATH = "/run/slurmdbd/slurmdbd.pid"  # the unit's RuntimeDirectory: slurm may write there
SLURMDBD_SETUP_PATH = "/usr/local/sbin/slurmdbd-setup"
DATABASE_DISK_SETUP_PATH = "/usr/local/sbin/database-disk"
# MariaDB on the head node: its settings beside the package's own (read after them), its data on the head
# node's data disk (its only one: LUN 0, infra/head.py), mounted where the package keeps its data.
MARIADB_CONF_PATH = "/etc/mysql/mariadb.conf.d/60-slurmdbd.cnf"
MARIADB_DATADIR = "/var/lib/mysql"
DATABASE_DISK = "/dev/disk/azure/scsi1/lun0"
MARIADB_PACKAGE = "mariadb-server"
# An Azure Database for MySQL's certificate chains to one of these roots (Azure's documentation, and the
# bundle cyclecloud-slurm ships for it); the head node takes them from its own trust store.
AZURE_MYSQL_CA_BUNDLE = "/etc/slurm/azure-mysql-ca.pem"
AZURE_MYSQL_ROOTS = tuple(
    f"/usr/share/ca-certificates/mozilla/{name}.crt"
    for name in ("DigiCert_Global_Root_CA", "DigiCert_Global_Root_G2", "Microsoft_RSA_Root_Certificate_Authority_2017")
)
# The grant's SQL with this in place of the password: filled in where the password is (slurmdbd-setup, at boot).
PASSWORD_SLOT = "{password}"
# What a database password may hold: slurmdbd.conf cuts a value at '#' and at white space, and the SQL
# that sets it quotes it; no quotes, backslashes, '$', '#', '=' or spaces, then.
PASSWORD_RULE = "12-128 letters, digits and !%*+,-./:;<>?@[]^_{|}~ (no quotes, '#', '$', '=' or spaces)"
_PASSWORD = re.compile(r"[A-Za-z0-9!%*+,\-./:;<>?@\[\]^_{|}~]{12,128}")


@dataclass(frozen=True)
class AccountingDatabase:
    """Where slurmdbd keeps its records. ssl_ca: the CA bundle that the server's certificate must chain
    to (slurmdbd.conf StorageParameters=SSL_CA=...): None only for MariaDB on the loopback address."""

    host: str
    port: int = MYSQL_PORT
    user: str = STORAGE_USER
    ssl_ca: str | None = None

    def __post_init__(self) -> None:
        if self.host != LOOPBACK:
            check_hostname("database.host", self.host)
            if self.ssl_ca is None:
                raise ValueError(f"database.ssl_ca: a database at {self.host} is reached over TLS; name its CA file")
        check_int("database.port", self.port, 1, 65535)
        check_user("database.user", self.user)
        if self.ssl_ca is not None:
            check_path("database.ssl_ca", self.ssl_ca)


def render_slurmdbd_conf(
    *, dbd_host: str, dbd_address: str, database: AccountingDatabase, log_file: str = SLURMDBD_LOG_PATH
) -> str:
    """slurmdbd.conf, without StoragePass: slurmdbd on dbd_host (listening on dbd_address, where slurmctld
    and the Slurm commands reach it), its records in database."""
    lines = [
        "# Rendered by infra/cloud_init/accounting.py; StoragePass is added where the daemon runs.",
        "AuthType=auth/munge",
        f"DbdHost={check_name('dbd_host', dbd_host)}",
        f"DbdAddr={check_ipv4('dbd_address', dbd_address)}",
        "SlurmUser=slurm",
        f"LogFile={check_path('log_file', log_file)}",
        f"PidFile={SLURMDBD_PID_PATH}",
        "StorageType=accounting_storage/mysql",
        f"StorageHost={database.host}",
        f"StoragePort={database.port}",
        f"StorageUser={database.user}",
        f"StorageLoc={STORAGE_LOC}",
        # TLS to a database elsewhere: the server's certificate must chain to this CA bundle
        *([f"StorageParameters=SSL_CA={database.ssl_ca}"] if database.ssl_ca else []),
    ]
    return "\n".join(lines) + "\n"


def check_password(password: str) -> str:
    """password, if slurmdbd.conf and the grant's SQL can carry it; the error never shows it."""
    if not isinstance(password, str) or not _PASSWORD.fullmatch(password):
        raise ValueError(f"the database password must be {PASSWORD_RULE}")
    return password


def storage_pass_line(password: str) -> str:
    """The StoragePass line added to slurmdbd.conf where it runs."""
    return f"StoragePass={check_password(password)}\n"


def render_mariadb_conf(*, datadir: str, buffer_pool_mb: int | None) -> str:
    """The MariaDB server settings that Slurm's accounting page asks for, with the reason for each.
    buffer_pool_mb None: the buffer pool and redo log are sized where the server runs, from its memory
    (slurmdbd-setup.sh: MEMORY_SHARE of it, at least Slurm's 4 GiB where that is under half)."""
    return "\n".join(
        [
            "# Rendered by infra/cloud_init/accounting.py: Slurm's advice for slurmdbd's database (accounting.html).",
            "[mariadbd]",
            f"datadir={check_path('datadir', datadir)}",
            f"bind-address={LOOPBACK}",  # slurmdbd beside it is the only client
            f"port={MYSQL_PORT}",
            "skip-name-resolve",  # users are matched by address (slurm@127.0.0.1), no DNS at connect
            *(_memory_lines(buffer_pool_mb) if buffer_pool_mb is not None else []),
            f"innodb_lock_wait_timeout={LOCK_WAIT_TIMEOUT_S}",
            f"max_allowed_packet={MAX_ALLOWED_PACKET_MB}M",
            # ON (MariaDB 11.6.2 and later by default) fails a write that meets a concurrent change, and
            # slurmdbd stops on that error; loose-: a MariaDB without the variable starts all the same
            "loose-innodb_snapshot_isolation=OFF",
            "",
        ]
    )


def _memory_lines(buffer_pool_mb: int) -> list[str]:
    """The buffer pool (the working set: too small, and upgrades and purges of a large database fail) and
    the redo log (a quarter of the pool, so that writes are not flushed in small pieces; at most 1 GiB,
    as a larger one only lengthens recovery after a crash)."""
    pool = check_int("buffer_pool_mb", buffer_pool_mb, 8, 2**31)
    return [f"innodb_buffer_pool_size={pool}M", f"innodb_log_file_size={min(1024, max(48, pool // 4))}M"]


def database_grant_template() -> str:
    """SQL that makes slurmdbd's database user (or gives it the password again) with every right on its
    database and none elsewhere, PASSWORD_SLOT standing for the password; run by MariaDB's root, read from
    stdin or a file, never from argv."""
    user = f"'{STORAGE_USER}'@'{LOOPBACK}'"
    return (
        f"CREATE USER IF NOT EXISTS {user} IDENTIFIED BY '{PASSWORD_SLOT}';\n"
        f"ALTER USER {user} IDENTIFIED BY '{PASSWORD_SLOT}';\n"
        f"GRANT ALL ON {STORAGE_LOC}.* TO {user};\n"
    )


def render_database_grant(password: str) -> str:
    """database_grant_template with the password (checked as slurmdbd.conf will carry it)."""
    secret = storage_pass_line(password).split("=", 1)[1].strip()
    return database_grant_template().replace(PASSWORD_SLOT, secret)


def render_associations(*, cluster_name: str, users: list[str]) -> str:
    """`sacctmgr load` input: the cluster, its default account (DEFAULT_ACCOUNT) and users whose default
    account it is. Loading it again changes nothing: setup runs it at every start."""
    if not users:
        raise ValueError("users: at least one user submits jobs")
    members = "".join(f"User - '{check_user('users', user)}':DefaultAccount='{DEFAULT_ACCOUNT}'\n" for user in users)
    return (
        f"Cluster - '{check_name('cluster_name', cluster_name)}'\n"
        "Parent - 'root'\n"
        f"Account - '{DEFAULT_ACCOUNT}':Description='the cluster default account':Organization='{DEFAULT_ACCOUNT}'\n"
        f"Parent - '{DEFAULT_ACCOUNT}'\n"
        f"{members}"
    )


@dataclass(frozen=True)
class HeadAccounting:
    """slurmdbd on the head node: the Slurm cluster it records, where its records go (MariaDB on the head
    node, or an Azure Database for MySQL) and the users whose default account is the cluster's."""

    cluster_name: str
    dbd_host: str  # the head node's host name and address: slurmdbd listens there
    dbd_address: str
    database: AccountingDatabase
    users: Sequence[str]

    @property
    def local(self) -> bool:
        """Whether the database is MariaDB on the head node."""
        return self.database.host == LOOPBACK


def head_accounting_files(
    accounting: HeadAccounting, *, vault_uri: str, identity_client_id: str
) -> list[dict[str, Any]]:
    """The head node's write_files for slurmdbd: its configuration without the password (which
    slurmdbd-setup reads from Key Vault at boot with identity_client_id), the associations, the setup
    program, and with MariaDB on the head node its settings and the program that mounts its disk. The
    settings come before MariaDB's package, which starts it; the rest after (deferred)."""
    local = accounting.local
    setup = render_script(
        "boot/slurmdbd-setup.sh",
        {
            "VAULT_URI": check_vault_uri(vault_uri),
            "SECRET_NAME": DATABASE_PASSWORD_SECRET,
            "IDENTITY_CLIENT_ID": check_client_id("identity_client_id", identity_client_id),
            "LOCAL_DATABASE": int(local),
            "MEMORY_CONF": MARIADB_MEMORY_CONF_PATH,
            "MEMORY_SHARE": MEMORY_SHARE,
            "MIN_BUFFER_POOL_MB": MIN_BUFFER_POOL_MB,
            "GRANT_SQL": database_grant_template(),
            "CA_BUNDLE": accounting.database.ssl_ca or "",
            "CA_SOURCES": list(AZURE_MYSQL_ROOTS) if accounting.database.ssl_ca else [],
            "TEMPLATE": SLURMDBD_TEMPLATE_PATH,
            "CONF": SLURMDBD_CONF_PATH,
            "ASSOCIATIONS": ASSOCIATIONS_PATH,
        },
    )
    conf = render_slurmdbd_conf(
        dbd_host=accounting.dbd_host, dbd_address=accounting.dbd_address, database=accounting.database
    )
    associations = render_associations(cluster_name=accounting.cluster_name, users=list(accounting.users))
    files = [
        write_file(SLURMDBD_SETUP_PATH, setup, "0755"),
        write_file(SLURMDBD_TEMPLATE_PATH, conf, "0600", defer=True),
        write_file(ASSOCIATIONS_PATH, associations, "0644", defer=True),
    ]
    if local:
        disk = render_script("boot/database-disk.sh", {"DATA_DISK": DATABASE_DISK, "MOUNT_PATH": MARIADB_DATADIR})
        files += [
            write_file(MARIADB_CONF_PATH, render_mariadb_conf(datadir=MARIADB_DATADIR, buffer_pool_mb=None), "0644"),
            write_file(DATABASE_DISK_SETUP_PATH, disk, "0755"),
        ]
    return files
