"""The cluster's people: the users list, as the stack config seeds it and `dtrain users` changes it.

The head node keeps the list on the shared file system (`<shared>/.users/users.json`, root's, 0644:
public keys only), and every host (head, nodes, NFS server, jumpbox) applies it with
dtrain/remote/boot/apply_users.py within a minute: an account with the list's uid (the same on every
host, which NFS needs), a home on the shared file system, the person's key in KEYS_DIR. This module is
the list's schema and its names; it imports without Pulumi (the operator's CLI reads it too).
"""

from __future__ import annotations

import json
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from infra.azure_limits import RESERVED_ADMIN_USERS
from infra.ssh_key import check_public_key

# Beneath the shared mount: the list, each host's last application of it, the people's homes.
USERS_DIR = ".users"
LIST_FILE = "users.json"
APPLIED_DIR = "applied"  # .users/applied/<host>: the digest of the list the host applied last, and its errors
HOMES_DIR = "home"
# The jumpbox has no shared file system: `dtrain users` copies the list here after each change.
JUMPBOX_LIST = "/var/lib/dtrain-users/users.json"
# sshd reads each person's key from here (root's files): a key outside the home, which the person cannot
# change, and which goes with the account.
KEYS_DIR = "/etc/ssh/dtrain-users"
# What apply_users.py writes in the GECOS field of the accounts it makes: the ones it may remove.
ACCOUNT_MARKER = "dtrain user"
# Above the image's own accounts (Azure's admin user is 1000) and below the 65534 of nobody.
FIRST_UID, LAST_UID = 20000, 59999
MAX_GPU_HOURS = 10_000_000  # a budget per month: a thousand 8-GPU nodes all month is under 6 million
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # useradd's own rule (NAME_REGEX), 32 characters
SLURM_ACCOUNT = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,63}")
# Names that are the hosts' own accounts (Slurm's, munge's, the daemons'), whatever the image.
SYSTEM_NAMES = frozenset({"slurm", "munge", "nobody", "sshd", "daemon", "docker", "mlflow", "prometheus"})


class AccountLimits(BaseModel):
    """What Slurm's accounting may cap for all the jobs of an account's members together (the account's
    association's limits); None: no cap."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    max_gpus: Annotated[int, Field(ge=1, le=100_000)] | None = None  # all running jobs together (GrpTRES gres/gpu)
    # GPU-hours per calendar month, all the jobs together (GrpTRESMins gres/gpu, in whole GPU-minutes: Slurm
    # resets the usage on the 1st, PriorityUsageResetPeriod=MONTHLY); 0: no GPU at all
    gpu_hours: Annotated[float, Field(ge=0, le=MAX_GPU_HOURS, allow_inf_nan=False)] | None = None

    @field_validator("gpu_hours")
    @classmethod
    def _whole_minutes(cls, value: float | None) -> float | None:
        if value and gpu_minutes(value) == 0:
            raise ValueError(f"{value} GPU-hours is less than a GPU-minute, Slurm's unit: give 0 or at least 0.01")
        return value

    def describe(self) -> str:
        """The limits in words, `-` for none: `4 jobs at once, 2 nodes a job, 8 GPUs at once, 100 GPU-hours a month`."""
        given = self.model_dump()
        shown = [(given[field], text) for field, text in LIMIT_WORDS.items() if given.get(field) is not None]
        return ", ".join(f"{v:g} {text.format('' if v == 1 else 's')}" for v, text in shown) or "-"


class UserLimits(AccountLimits):
    """What Slurm's accounting may cap for a person (their association's limits); None: no cap. Their
    account's limits hold as well: a job starts within both."""

    max_jobs: Annotated[int, Field(ge=1, le=100_000)] | None = None  # running at once (MaxJobs)
    max_nodes: Annotated[int, Field(ge=1, le=10_000)] | None = None  # per job (MaxNodes)


# Each limit in words, in the order `describe` gives them
LIMIT_WORDS = {
    "max_jobs": "job{} at once",
    "max_nodes": "node{} a job",
    "max_gpus": "GPU{} at once",
    "gpu_hours": "GPU-hour{} a month",
}


def gpu_minutes(hours: float) -> int:
    """A GPU-hour budget as Slurm's GrpTRESMins counts it: whole GPU-minutes, the nearest (apply_users.py's too)."""
    return round(hours * 60)


class ClusterUser(BaseModel):
    """One person: their name on every host, uid (None in the stack config: given in the list's order),
    public key, Slurm account and optional limits."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    name: str
    uid: Annotated[int, Field(ge=FIRST_UID, le=LAST_UID)] | None = None
    ssh_public_key: str
    account: str
    limits: UserLimits = Field(default_factory=UserLimits)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_user_name(value)

    @field_validator("ssh_public_key")
    @classmethod
    def _key(cls, value: str) -> str:
        return check_public_key(value)

    @field_validator("account")
    @classmethod
    def _account(cls, value: str) -> str:
        return check_account_name(value)


def check_account_name(name: str) -> str:
    if not SLURM_ACCOUNT.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a Slurm account name: lower-case letters, digits, '_', '.' and '-', up to 64"
        )
    return name


def check_user_name(name: str) -> str:
    if not USER_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a user name: up to 32 lower-case letters, digits, '_' and '-', starting with a letter "
            "or '_'"
        )
    if name in RESERVED_ADMIN_USERS or name in SYSTEM_NAMES:
        raise ValueError(f"{name!r} is an account the hosts keep for themselves (or Azure reserves): choose another")
    return name


AccountName = Annotated[str, AfterValidator(check_account_name)]


class UsersList(BaseModel):
    """The list the head keeps: every person with a uid, names and uids unique; and the limits of the accounts
    that have any (all their members' jobs together)."""

    model_config = ConfigDict(extra="forbid")

    users: list[ClusterUser] = Field(default_factory=list)
    accounts: dict[AccountName, AccountLimits] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique(self) -> UsersList:
        names = [user.name for user in self.users]
        uids = [user.uid for user in self.users]
        if None in uids:
            raise ValueError("every user in the list has a uid")
        for what, values in (("name", names), ("uid", uids)):
            repeated = sorted({str(v) for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"the {what} {', '.join(repeated)} is given to more than one user")
        return self

    def document(self) -> str:
        """The list as the hosts read it (users.json; `accounts` only where one has limits)."""
        users = [user.model_dump(mode="json", exclude_none=True) for user in self.users]
        accounts = {name: limits.model_dump(mode="json", exclude_none=True) for name, limits in self.accounts.items()}
        document = {"users": users} | ({"accounts": accounts} if accounts else {})
        return json.dumps(document, indent=2, sort_keys=True) + "\n"


def with_uids(
    users: list[ClusterUser], admin_user: str | None = None, accounts: dict[str, AccountLimits] | None = None
) -> UsersList:
    """The stack config's users with a uid each: their own, else the next free one from FIRST_UID in the
    list's order, and its accounts' limits. admin_user: refused as a person's name (the operators' account
    is not in the list)."""
    taken = {user.uid for user in users if user.uid is not None}
    given: list[ClusterUser] = []
    next_uid = FIRST_UID
    for user in users:
        if user.name == admin_user:
            raise ValueError(f"{user.name!r} is the admin user: the operators' account is not a person of the list")
        if user.uid is None:
            while next_uid in taken:
                next_uid += 1
            taken.add(next_uid)
            user = user.model_copy(update={"uid": next_uid})
        given.append(user)
    return UsersList(users=given, accounts=accounts or {})
