"""The cluster's people, from the admin's machine: the users list the head node keeps on the shared file
system, read and changed over SSH by dtrain/remote/login/users_list.py (as root: the admin's sudo on
Azure), and each host's report of applying it (dtrain/remote/boot/apply_users.py).

The jumpbox has no shared file system: where the description's jump host is another machine than the
login node (Azure), the list is also copied there after each change, where its own timer applies it.
"""

from __future__ import annotations

import json
import posixpath
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from dtrain.checks import describe_validation_error
from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH, as_root, q
from dtrain.errors import ExitCode, OperatorError
from infra.users import JUMPBOX_LIST, USERS_DIR, AccountLimits, ClusterUser, UserLimits, UsersList

USERS_LIST_TOOL = Path(__file__).resolve().parents[1] / "remote" / "login" / "users_list.py"
# Azure's hosts apply the list every 30 s (dtrain-users.timer): a host whose report is older than this is off
# (a powered-down node applies the list at its next boot, before slurmd starts).
FRESH_S = 90.0
APPLY_WAIT_S = 120.0  # how long a change waits for every host that is up to apply it
POLL_S = 1.0
_EXIT_BAD_INPUT = 2  # users_list.py's, for a name already in the list or not in it, or an account no one is in


@dataclass(frozen=True)
class HostReport:
    host: str
    digest: str | None
    errors: list[str]
    age_s: float
    fresh: bool


@dataclass(frozen=True)
class UsersState:
    users: list[ClusterUser]
    digest: str  # of the list as the head keeps it: what a host's report names once it applied it
    reports: list[HostReport] = field(default_factory=list)
    accounts: dict[str, AccountLimits] = field(default_factory=dict)  # the accounts that have limits

    def pending(self) -> list[str]:
        """The hosts that are up and have not applied this list yet."""
        return [r.host for r in self.reports if r.fresh and r.digest != self.digest]

    def errors(self) -> list[str]:
        """What the hosts that applied this list could not do, `host: reason`."""
        return [f"{r.host}: {e}" for r in self.reports if r.digest == self.digest for e in r.errors]


def users_dir(desc: ClusterDescription) -> str:
    return posixpath.join(desc.shared_mount_path, USERS_DIR)


def _call(desc: ClusterDescription, slurm: Slurm, args: list[str], *, root: bool) -> UsersState:
    command = f"{q(desc.remote_python)} - {' '.join(q(a) for a in args)}"
    result = slurm.run_unchecked(as_root(command) if root else command, input=USERS_LIST_TOOL.read_bytes())
    if result.returncode == _EXIT_BAD_INPUT:
        raise OperatorError(result.stderr.strip().splitlines()[-1])
    if result.returncode != 0 and "sudo" in result.stderr:
        raise OperatorError(
            f"only the cluster's admin may change its users: sudo on the login node refused {desc.ssh_user} "
            f"({result.stderr.strip().splitlines()[-1]})",
            ExitCode.NOT_READY,
        )
    try:
        document = json.loads(result.stdout)
        listed = UsersList.model_validate({"users": document["users"], "accounts": document.get("accounts", {})})
    except (json.JSONDecodeError, KeyError, TypeError):
        raise OperatorError(
            f"reading the users list on the login node failed: {(result.stderr or result.stdout).strip()[-400:]}",
            ExitCode.FAILED,
        ) from None
    except ValidationError as exc:
        raise OperatorError(f"the users list on the login node is invalid: {describe_validation_error(exc)}") from None
    reports = [HostReport(host=host, **report) for host, report in document["reports"].items()]
    return UsersState(listed.users, document["digest"], reports, listed.accounts)


def show(desc: ClusterDescription, slurm: Slurm) -> UsersState:
    """The list and the hosts' reports; any user may read them."""
    return _call(desc, slurm, ["show", users_dir(desc), "--fresh-s", str(FRESH_S)], root=False)


def add(desc: ClusterDescription, slurm: Slurm, ssh: SSH, user: ClusterUser) -> UsersState:
    """Put the person in the list, with the lowest free uid; the admin's."""
    entry = json.dumps(user.model_dump(mode="json", exclude={"uid"}, exclude_none=True))
    state = _call(desc, slurm, ["add", users_dir(desc), "--entry", entry, "--fresh-s", str(FRESH_S)], root=True)
    _copy_to_jump_host(desc, ssh, state)
    return state


def remove(desc: ClusterDescription, slurm: Slurm, ssh: SSH, name: str) -> UsersState:
    """Take the person out of the list, their jobs cancelled first; the admin's."""
    args = ["remove", users_dir(desc), name, "--fresh-s", str(FRESH_S)]
    conf = slurm.access.conf
    state = _call(desc, slurm, args + (["--slurm-conf", conf] if conf else []), root=True)
    _copy_to_jump_host(desc, ssh, state)
    return state


def limit(desc: ClusterDescription, slurm: Slurm, ssh: SSH, name: str, limits: UserLimits, clear: bool) -> UsersState:
    """Set the limits given (not None) of a person in the list; with clear, every other one goes. The admin's."""
    return _set_limits(desc, slurm, ssh, ["limit", users_dir(desc), name], limits, clear)


def limit_account(
    desc: ClusterDescription, slurm: Slurm, ssh: SSH, account: str, limits: AccountLimits, clear: bool
) -> UsersState:
    """Set the limits given (not None) of an account a person of the list is in; with clear, every other one
    goes. The admin's."""
    return _set_limits(desc, slurm, ssh, ["limit-account", users_dir(desc), account], limits, clear)


def _set_limits(
    desc: ClusterDescription, slurm: Slurm, ssh: SSH, command: list[str], limits: AccountLimits, clear: bool
) -> UsersState:
    given = json.dumps(limits.model_dump(mode="json", exclude_none=True))
    args = [*command, "--set", given, "--fresh-s", str(FRESH_S), *(["--clear"] if clear else [])]
    state = _call(desc, slurm, args, root=True)
    _copy_to_jump_host(desc, ssh, state)
    return state


def _copy_to_jump_host(desc: ClusterDescription, ssh: SSH, state: UsersState) -> None:
    """The jumpbox's own copy of the list (it has no shared file system), where a jump host is another machine."""
    if desc.jump_host is None or desc.slurm is None or desc.slurm.login == desc.jump_host:
        return
    document = UsersList(users=state.users, accounts=state.accounts).document()
    ssh.run(ssh.jump, as_root(f"install -D -m 0644 /dev/stdin {q(JUMPBOX_LIST)}"), input=document, timeout=60)


def wait_applied(
    desc: ClusterDescription, slurm: Slurm, state: UsersState, timeout: float = APPLY_WAIT_S
) -> UsersState:
    """Until every host that is up has applied state's list (its report names the list's digest), for up
    to timeout; the last state read (its pending() names the late hosts)."""
    deadline = time.monotonic() + timeout
    while state.pending() and time.monotonic() < deadline:
        time.sleep(POLL_S)
        state = show(desc, slurm)
    return state
