"""Each emulated host's own accounts, and the loop that applies the cluster's users list there.

Where the hosts are namespaces of one machine, they would share its /etc, hence its accounts: a person
added on a node would exist everywhere at once, and a uid missing on one host could never be seen. So
in netns mode `up` gives every host (the head, which is also the login and jump host here; the NFS
server; each node) a copy of this machine's /etc, STATE/etc/<host>, which its processes see at /etc
(a bind mount in their own mount namespace): `useradd` there changes that host alone, as on Azure.

Each host runs dtrain/remote/boot/apply_users.py, the script Azure's hosts run from a timer, in a loop
(every APPLY_INTERVAL_S) inside its namespaces: the head makes the homes and opens runs/ and data/ to
the team and makes each person a Slurm user of their account (slurmdbd runs in the head namespace,
dtrain/local/accounting.py); every host writes its report to <shared>/.users/applied/<host>.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from dtrain.local.state import LocalState
from infra.contract import RUNS_DIR, WORKDIRS_DIR
from infra.users import APPLIED_DIR, HOMES_DIR, LIST_FILE, USERS_DIR

APPLY_USERS = Path(__file__).resolve().parents[1] / "remote" / "boot" / "apply_users.py"
APPLY_INTERVAL_S = 2  # Azure's timer: 30 s (dtrain-users.timer); here a host is a loop of one process
LOGIN_HOST = "head"  # the host whose /etc the jump host and slurmctld see: Azure's head is the login node
STORAGE_HOST = "nfs"


def etc_dir(state: LocalState, host: str) -> Path:
    return Path(state.state_dir) / "etc" / host


def make_etc(state: LocalState, host: str, hosts_file: str | None = None) -> None:
    """The host's own /etc: a copy of this machine's, with hosts_file as its /etc/hosts where given
    (`ip netns exec` binds the namespace's over /etc/hosts, which the copy hides)."""
    target = etc_dir(state, host)
    target.parent.mkdir(mode=0o700, exist_ok=True)  # the copies' shadow files are root's alone
    # (every file root's: what the hosts' accounts need of it keeps its mode; /etc/netns changes as
    # other clusters come and go, and is no host's business)
    shutil.copytree("/etc", target, symlinks=True, ignore=shutil.ignore_patterns("netns"))
    target.chmod(0o755)  # what the host sees as /etc
    if hosts_file is not None:
        (target / "hosts").unlink(missing_ok=True)  # a link to the machine's would be written through
        (target / "hosts").write_text(hosts_file)


def bind_etc(state: LocalState, host: str) -> str:
    """The shell command, for a process in a mount namespace of its own, that shows it the host's /etc."""
    return f"mount --bind {etc_dir(state, host)} /etc"


def agent_role(host: str) -> str:
    return f"users-{host}"


def shared_dir(state: LocalState) -> Path:
    return Path(state.state_dir) / "shared"


def agent_argv(state: LocalState, host: str, enter: Sequence[str], python: str) -> list[str]:
    """The loop that applies the users list on host with python, started with enter (the argv prefix that
    puts a command in the host's namespaces, where its /etc is). The login host keeps the homes, opens
    the team's directories and applies Slurm's associations, as Azure's head node does."""
    shared = shared_dir(state)
    users = shared / USERS_DIR
    args = ["--list", str(users / LIST_FILE), "--host", host, "--home-root", str(shared / HOMES_DIR)]
    args += ["--report-dir", str(users / APPLIED_DIR)]
    if host == LOGIN_HOST:
        runs = shared / RUNS_DIR
        args += ["--make-homes", *(f"--team-dir={d}" for d in (runs, runs / WORKDIRS_DIR, shared / "data"))]
        args += ["--slurm-users", str(Path(state.state_dir) / "slurm-users")]
    loop = f'while :; do "$0" "$@"; sleep {APPLY_INTERVAL_S}; done'
    env = ["env", f"SLURM_CONF={state.slurm_conf}"] if state.slurm_conf else []  # sacctmgr's cluster
    return [*enter, *env, "sh", "-c", loop, python, str(APPLY_USERS), *args]
