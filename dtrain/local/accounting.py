"""The local cluster's accounting database: Debian's MariaDB and slurmdbd in the head namespace, as on the
Azure head node, with infra's slurmdbd.conf, MariaDB settings and associations
(infra/cloud_init/accounting.py).

  mariadbd   in the head namespace on 127.0.0.1:3306 (that namespace's own loopback: nothing else on
             this machine reaches it), its data in STATE/mariadb: a copy of the system tables that
             `mariadb-install-db` made once (cached in ~/.cache/azure-horovod/mariadb-<hash>); its
             socket, for the setup only, in the cluster's short runtime directory. `up` starts all of
             this while the sshds and Azurite start.
  slurmdbd   in the head namespace, with the hostname slurmdbd.conf's DbdHost names (head), on the head's
             address, port 6819, where slurmctld and this machine's sacct reach it.
Then `sacctmgr load` makes the cluster, its default account and this machine's user (root) its member:
AccountingStorageEnforce=associations runs no job without them. All of it before slurmctld starts (which
then finds its cluster registered), and while the sshds and Azurite start: `up` waits for them after.

What differs from Azure's: everything runs as root; MariaDB's buffer pool is small (a test cluster keeps a
few hundred jobs: slurmdbd logs that the value is below its advice) and InnoDB does not flush each commit to
disk (a local cluster lives minutes and `down` removes it); the database password is made per cluster and
kept in STATE (0600), where Azure's comes from Key Vault.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

from dtrain.errors import ExitCode, OperatorError
from dtrain.fileio import atomic_write
from dtrain.local import slurm_conf
from dtrain.local.daemons import log_tail, wait_port, wait_socket_file
from dtrain.local.nodes import start_daemon
from dtrain.local.state import LocalState
from infra.cloud_init.accounting import (
    LOOPBACK,
    AccountingDatabase,
    render_associations,
    render_database_grant,
    render_mariadb_conf,
    render_slurmdbd_conf,
    storage_pass_line,
)
from infra.contract import SLURMDBD_PORT

MARIADB_ROLE = "mariadb"
SLURMDBD_ROLE = "slurmdbd"
MARIADBD = f"{slurm_conf.SBIN}/mariadbd"
INSTALL_DB = "/usr/bin/mariadb-install-db"
SLURMDBD = f"{slurm_conf.SBIN}/slurmdbd"
TOOLS = (MARIADBD, INSTALL_DB, SLURMDBD, "sacctmgr")
INSTALL_HINT = "run tools/setup_system.sh (apt-get install mariadb-server slurmdbd)"
BUFFER_POOL_MB = 64
# On a loaded machine: mariadb-install-db takes 1 s unloaded, slurmdbd creates its tables in another.
INSTALL_TIMEOUT_S = 120
START_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 60


def database_dir(state: LocalState) -> Path:
    return Path(state.state_dir) / "mariadb"


def _mariadb_conf(state: LocalState) -> Path:
    return Path(state.state_dir) / "slurm" / "mariadb.cnf"


def _socket(state: LocalState) -> Path:
    return slurm_conf.SlurmFiles(Path(state.state_dir)).runtime / "mariadb.socket"


def _grant_file(state: LocalState) -> Path:
    return Path(state.state_dir) / "slurm" / "mariadb-grant.sql"


def slurmdbd_conf_path(files: slurm_conf.SlurmFiles) -> Path:
    """slurmdbd reads slurmdbd.conf beside slurm.conf (SLURM_CONF's directory)."""
    return files.conf.with_name("slurmdbd.conf")


def create_database(state: LocalState) -> None:
    """MariaDB's system tables in STATE/mariadb: a copy of the ones `mariadb-install-db` made once for this
    MariaDB and these settings (cached: it takes a second of CPU, several on a busy machine, and every
    local cluster needs the same tables)."""
    template = _database_template(state)
    shutil.copytree(template, database_dir(state))
    database_dir(state).chmod(0o700)


def _database_template(state: LocalState) -> Path:
    """The cached data directory for this MariaDB and the settings that shape its files, made if missing
    (under a lock: two clusters may start at once)."""
    binary = Path(MARIADBD).stat()
    shape = f"{binary.st_size}-{binary.st_mtime_ns}-{BUFFER_POOL_MB}"
    digest = hashlib.sha256(shape.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "azure-horovod"
    template = cache / f"mariadb-{digest}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "mariadb.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.is_dir():
            building = Path(tempfile.mkdtemp(prefix="mariadb-", dir=cache))
            try:
                _install_db(state, building)
                building.rename(template)
            finally:
                shutil.rmtree(building, ignore_errors=True)
    return template


def _install_db(state: LocalState, datadir: Path) -> None:
    """`mariadb-install-db` into datadir, with the cluster's settings (its log file's size among them)."""
    log = state.logs / "mariadb-install-db.log"
    argv = [INSTALL_DB, f"--defaults-file={_mariadb_conf(state)}", f"--datadir={datadir}", "--user=root",
            "--skip-test-db", "--auth-root-authentication-method=socket"]  # fmt: skip
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=INSTALL_TIMEOUT_S, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            message = f"mariadb-install-db did not finish within {INSTALL_TIMEOUT_S}s{log_tail(log)}"
            raise OperatorError(message, ExitCode.TIMED_OUT) from None
    if done.returncode != 0:
        raise OperatorError(f"mariadb-install-db failed (exit {done.returncode}){log_tail(log)}", ExitCode.FAILED)


def _local_mariadb_conf(state: LocalState) -> str:
    """infra's settings with this machine's paths, and InnoDB flushing to the OS rather than the disk."""
    lines = [
        f"socket={_socket(state)}",
        f"pid-file={database_dir(state)}/mariadbd.pid",
        # a commit reaches the OS at once and the disk within a second: enough for a cluster of minutes
        "innodb_flush_log_at_trx_commit=2",
        "innodb_doublewrite=0",
        "",
    ]
    return render_mariadb_conf(datadir=str(database_dir(state)), buffer_pool_mb=BUFFER_POOL_MB) + "\n".join(lines)


def write_config(state: LocalState, files: slurm_conf.SlurmFiles, dbd_address: str) -> None:
    """slurmdbd.conf (Azure's, on this machine's paths, with a password made for this cluster) and the SQL
    that gives slurmdbd's database user that password when MariaDB starts."""
    password = secrets.token_hex(24)
    azure = render_slurmdbd_conf(
        dbd_host=slurm_conf.CONTROLLER_HOST,
        dbd_address=dbd_address,
        database=AccountingDatabase(host=LOOPBACK),
        log_file="/dev/null",  # its stderr is its log, as every local daemon's (STATE/logs/slurmdbd.log)
    )
    conf = slurm_conf.override(
        azure,
        {
            "SlurmUser": "root",  # as every local daemon
            "AuthInfo": f"socket={files.munge_socket}",
            "PidFile": str(files.root / "slurmdbd.pid"),
        },
    )
    atomic_write(slurmdbd_conf_path(files), conf + storage_pass_line(password), 0o600)
    atomic_write(_mariadb_conf(state), _local_mariadb_conf(state), 0o600)
    slurmdbd_link(files).unlink(missing_ok=True)
    slurmdbd_link(files).symlink_to(SLURMDBD)
    atomic_write(_grant_file(state), render_database_grant(password), 0o600)


def start(state: LocalState, files: slurm_conf.SlurmFiles, users: list[str]) -> None:
    """MariaDB, then slurmdbd, in the head namespace; then the cluster's associations. Returns once
    slurmdbd holds them: slurmctld refuses its first start without slurmdbd, and runs no job without them."""
    head = state.head
    assert head is not None and head.namespace  # netns mode wires the head first
    # --init-file: the grant at every start (a restarted server keeps the user), before it serves anyone
    mariadbd = [MARIADBD, f"--defaults-file={_mariadb_conf(state)}", "--user=root", f"--init-file={_grant_file(state)}"]
    start_daemon(state, MARIADB_ROLE, ["ip", "netns", "exec", head.namespace, *mariadbd], str(_mariadb_conf(state)))
    wait_socket_file(_socket(state), START_TIMEOUT_S, "MariaDB", state.logs / f"{MARIADB_ROLE}.log")
    start_daemon(state, SLURMDBD_ROLE, slurmdbd_argv(head.namespace, files), str(slurmdbd_link(files)))
    wait_port(head.address, SLURMDBD_PORT, START_TIMEOUT_S, "slurmdbd", state.logs / "slurmdbd.log")
    load_associations(state, files, users)


def slurmdbd_link(files: slurm_conf.SlurmFiles) -> Path:
    """slurmdbd under a name of this cluster's: its command line has no path to a file of the cluster (it
    reads slurmdbd.conf from SLURM_CONF's directory), and the record's marker needs one."""
    return files.root / "slurmdbd"


def slurmdbd_argv(namespace: str, files: slurm_conf.SlurmFiles) -> list[str]:
    """slurmdbd in the head namespace with the hostname slurmdbd.conf's DbdHost names (it refuses any other),
    reading slurmdbd.conf beside slurm.conf."""
    script = f'hostname {slurm_conf.CONTROLLER_HOST} && export SLURM_CONF="$0" && exec "$1" -D -s'
    return [
        "ip",
        "netns",
        "exec",
        namespace,
        "unshare",
        "--uts",
        "sh",
        "-c",
        script,
        str(files.conf),
        str(slurmdbd_link(files)),
    ]


def load_associations(state: LocalState, files: slurm_conf.SlurmFiles, users: list[str]) -> None:
    """`sacctmgr load` of the cluster, its default account and users (changes nothing when they are there)."""
    associations = files.root / "associations.cfg"
    atomic_write(associations, render_associations(cluster_name=state.slurm_cluster_name, users=users))
    proc = subprocess.run(
        ["sacctmgr", "--immediate", "load", str(associations)],
        env={**os.environ, **slurm_conf.client_env(files.conf)},
        capture_output=True,
        text=True,
        timeout=LOAD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        reason = (proc.stderr or proc.stdout).strip()
        raise OperatorError(
            f"sacctmgr could not load the cluster's associations: {reason}{log_tail(state.logs / 'slurmdbd.log')}",
            ExitCode.FAILED,
        )
