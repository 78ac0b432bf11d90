"""`users add|remove|limit|limit-account|list`: the people of a running cluster, without reimaging a node.

The head node keeps the list (dtrain/cluster/users.py); every host applies it within a minute, and
each command that changes it waits until every host that is up has. Adding, removing and limiting is the
admin's (their description, their sudo on Azure); anyone may list.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError
from rich.table import Table

from dtrain.checks import read_text_file
from dtrain.cli_entry import add_cluster_option, arg_type, int_between, non_negative_number
from dtrain.cluster import users as cluster_users
from dtrain.cluster.description import check_person_name, load
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH
from dtrain.errors import ExitCode, OperatorError
from dtrain.ui import make_console
from infra.users import LIMIT_WORDS, AccountLimits, ClusterUser, UserLimits, check_account_name

console = make_console()
out = make_console(stderr=False)

DESCRIPTION = """\
The cluster's people. Each has an account with the same uid on every host (head, nodes, NFS server,
jumpbox), a home on the shared file system, their own key and their own cluster description
(`cluster for-user`, or on Azure `cluster from-stack --user NAME`). Their runs, secrets, checkpoints
and workdirs are theirs alone (0700). The stack config's `users` seeds the list; from then on the head
node keeps it and these commands change it. The admin user is not in the list: its key stays the
operators'."""
EXAMPLES = """\
examples:
  python -m dtrain users add alice --ssh-key alice.pub --account vision
  python -m dtrain users add bob --ssh-key bob.pub --account nlp --max-gpus 16 --max-jobs 4
  python -m dtrain users limit alice --gpu-hours 500 --max-gpus 8   # a budget a month, a cap at once
  python -m dtrain users limit alice --clear                        # no limits at all
  python -m dtrain users limit-account vision --max-gpus 32 --gpu-hours 5000   # all its members together
  python -m dtrain users list
  python -m dtrain users remove bob        # ends bob's logins and jobs; keeps bob's runs
"""
# UserLimits' fields -> the flags that set them, in the order `describe` gives them (AccountLimits' are some)
LIMIT_FLAGS = {field: "--" + field.replace("_", "-") for field in LIMIT_WORDS}
ACCOUNT_LIMIT_FLAGS = {field: LIMIT_FLAGS[field] for field in AccountLimits.model_fields}


def configure(commands: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = commands.add_parser(
        "users", help="the cluster's people: add, remove, list", description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=raw,
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    add = actions.add_parser(
        "add",
        help="give a person an account on every host (the admin's)",
        description="Add a person to the users list; every host that is up makes their account (the next free "
        "uid from 20000, the same everywhere) within a minute, and this waits for it.",
        epilog="example:\n  python -m dtrain users add alice --ssh-key alice.pub --account vision --max-gpus 8\n",
        formatter_class=raw,
    )
    add.add_argument("name", type=arg_type(check_person_name), help="their user name on every host")
    add.add_argument("--ssh-key", required=True, metavar="FILE", help="their SSH public key (a .pub file)")
    add.add_argument("--account", required=True, help="their Slurm account (what their jobs are charged to)")
    _add_limit_arguments(add, "no cap")
    remove = actions.add_parser(
        "remove",
        help="end a person's access (the admin's); their runs stay",
        description="Take a person out of the users list: their jobs are cancelled, every host ends their "
        "logins and removes their account within a minute (this waits for it). Their home, run directories "
        "and results stay.",
        epilog="example:\n  python -m dtrain users remove bob\n",
        formatter_class=raw,
    )
    remove.add_argument("name", type=arg_type(check_person_name), help="their user name")
    limit = actions.add_parser(
        "limit",
        help="change a person's limits and GPU-hour budget (the admin's)",
        description="Change the limits of a person in the users list: the flags given are set, the others "
        "kept (--clear: dropped). The head node makes their Slurm association follow within a minute (this "
        "waits for it): a job over a limit waits in the queue, held, with the reason `jobs` shows. The GPU-hour "
        "budget counts every GPU-minute their jobs held this calendar month (Slurm resets it on the 1st, 00:00 "
        "UTC); a job starts only if its time limit x GPUs fits in what is left.",
        epilog="examples:\n  python -m dtrain users limit alice --gpu-hours 500\n"
        "  python -m dtrain users limit bob --max-gpus 8 --max-jobs 2\n"
        "  python -m dtrain users limit bob --clear --gpu-hours 100   # only a budget\n",
        formatter_class=raw,
    )
    limit.add_argument("name", type=arg_type(check_person_name), help="their user name")
    _add_limit_arguments(limit, "unchanged")
    limit.add_argument("--clear", action="store_true", help="drop every limit this command does not set")
    limit_account = actions.add_parser(
        "limit-account",
        help="change an account's limits and GPU-hour budget, all its members together (the admin's)",
        description="Change the limits of a Slurm account that a person of the users list is in, over all its "
        "members' jobs together: the flags given are set, the others kept (--clear: dropped). Each person's own "
        "limits hold as well: a job starts within both. The head node makes the account's association follow "
        "within a minute (this waits for it); a job over the account's limit waits in the queue, held, with the "
        "reason `jobs` shows. The budget renews on the 1st, as a person's does.",
        epilog="examples:\n  python -m dtrain users limit-account vision --gpu-hours 5000\n"
        "  python -m dtrain users limit-account nlp --max-gpus 16\n"
        "  python -m dtrain users limit-account nlp --clear   # no limits on the account\n",
        formatter_class=raw,
    )
    limit_account.add_argument("account", type=arg_type(slurm_account), help="the Slurm account")
    _add_account_limit_arguments(limit_account, "unchanged", "the account's members'")
    limit_account.add_argument("--clear", action="store_true", help="drop every limit this command does not set")
    listing = actions.add_parser(
        "list",
        help="the people, and which hosts have applied the list",
        description="The users list the head node keeps, and each host's last application of it.",
        epilog="example:\n  python -m dtrain users list\n",
        formatter_class=raw,
    )
    handlers = (add, _run_add), (remove, _run_remove), (limit, _run_limit), (limit_account, _run_limit_account)
    for sub, handler in (*handlers, (listing, _run_list)):
        add_cluster_option(sub)
        sub.set_defaults(handler=handler)


def _add_limit_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--max-jobs", type=int_between(1), help=f"jobs they may run at once (default: {default})")
    parser.add_argument(
        "--max-nodes", type=int_between(1), help=f"nodes one job of theirs may use (default: {default})"
    )
    _add_account_limit_arguments(parser, default, "their")


def _add_account_limit_arguments(parser: argparse.ArgumentParser, default: str, whose: str) -> None:
    parser.add_argument(
        "--max-gpus", type=int_between(1), help=f"GPUs all {whose} running jobs may hold at once (default: {default})"
    )
    parser.add_argument(
        "--gpu-hours",
        type=non_negative_number,
        metavar="H",
        help=f"GPU-hours a calendar month, all {whose} jobs together; 0: no GPU job (default: {default})",
    )


def slurm_account(name: str) -> str:
    """A Slurm account name the users list may hold (infra/users.py's rule)."""
    try:
        return check_account_name(name)
    except ValueError as exc:
        raise OperatorError(str(exc)) from None


def person(args: argparse.Namespace) -> ClusterUser:
    """The person `users add` describes, checked before any connection."""
    key = read_text_file(Path(args.ssh_key).expanduser(), "--ssh-key").strip()
    if "PRIVATE KEY" in key:
        raise OperatorError(f"--ssh-key {args.ssh_key} is a private key: pass the public one (the .pub file)")
    limits = limits_given(args)
    try:
        return ClusterUser(name=args.name, ssh_public_key=key, account=args.account, limits=limits)
    except ValidationError as exc:
        raise _refusal(exc, {"ssh_public_key": f"--ssh-key {args.ssh_key}", "account": "--account"}) from None


def limits_given(args: argparse.Namespace) -> UserLimits:
    """The limits the flags set (the others None), checked before any connection."""
    try:
        return UserLimits(**{field: getattr(args, field) for field in LIMIT_FLAGS})
    except ValidationError as exc:
        raise _refusal(exc, LIMIT_FLAGS) from None


def account_limits_given(args: argparse.Namespace) -> AccountLimits:
    """The account limits the flags set (the others None), checked before any connection."""
    try:
        return AccountLimits(**{field: getattr(args, field) for field in ACCOUNT_LIMIT_FLAGS})
    except ValidationError as exc:
        raise _refusal(exc, ACCOUNT_LIMIT_FLAGS) from None


def _refusal(exc: ValidationError, flags: dict[str, str]) -> OperatorError:
    """The first thing wrong, named by the flag that gave it."""
    first = exc.errors()[0]
    field = str(first["loc"][0])
    return OperatorError(f"{flags.get(field, field)}: {first['msg'].removeprefix('Value error, ')}")


def _run_add(args: argparse.Namespace) -> int:
    user = person(args)
    desc = load(args.cluster)
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        state = cluster_users.add(desc, slurm, ssh, user)
        state = cluster_users.wait_applied(desc, slurm, state)
    added = next(u for u in state.users if u.name == user.name)
    console.print(f"{user.name} added: uid {added.uid}, Slurm account {user.account}", highlight=False)
    _say_applied(state)
    console.print(f"their description: python -m dtrain cluster for-user {user.name} --ssh-key THEIR_KEY", markup=False)
    return 0


def _run_remove(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        state = cluster_users.wait_applied(desc, slurm, cluster_users.remove(desc, slurm, ssh, args.name))
    console.print(f"{args.name} removed: their jobs cancelled; their home and runs are kept", highlight=False)
    _say_applied(state)
    return 0


def _run_limit(args: argparse.Namespace) -> int:
    limits = limits_given(args)
    state = _change_limits(args, "limit", limits, LIMIT_FLAGS, cluster_users.limit, args.name)
    now = next(u for u in state.users if u.name == args.name).limits
    console.print(f"{args.name}'s limits: {now.describe()}", highlight=False)
    _say_applied(state)
    return 0


def _run_limit_account(args: argparse.Namespace) -> int:
    limits = account_limits_given(args)
    state = _change_limits(
        args, "limit-account", limits, ACCOUNT_LIMIT_FLAGS, cluster_users.limit_account, args.account
    )
    now = state.accounts.get(args.account, AccountLimits())
    console.print(f"the account {args.account}'s limits: {now.describe()}", highlight=False)
    _say_applied(state)
    return 0


def _change_limits(
    args: argparse.Namespace,
    action: str,
    limits: AccountLimits,
    flags: dict[str, str],
    change: Callable[..., cluster_users.UsersState],
    whose: str,
) -> cluster_users.UsersState:
    """`users limit` or `limit-account`: the list changed on the head node (change: cluster_users' function for
    it) and applied everywhere; refused before any connection where no flag gives a limit and --clear is not given."""
    if not args.clear and not limits.model_dump(exclude_none=True):
        raise OperatorError(f"users {action}: give a limit to set ({', '.join(flags.values())}) or --clear")
    desc = load(args.cluster)
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        return cluster_users.wait_applied(desc, slurm, change(desc, slurm, ssh, whose, limits, args.clear))


def _say_applied(state: cluster_users.UsersState) -> None:
    """Where the list is applied; an error when a host could not apply it or did not in time."""
    done = [r.host for r in state.reports if r.digest == state.digest]
    console.print(f"applied on {', '.join(done) or 'no host yet'}", highlight=False)
    if state.errors():
        raise OperatorError(f"not applied everywhere: {'; '.join(state.errors())}", ExitCode.FAILED)
    if state.pending():
        raise OperatorError(
            f"{', '.join(state.pending())} did not apply the list within {cluster_users.APPLY_WAIT_S:.0f} s "
            "(see its dtrain-users.service log)",
            ExitCode.TIMED_OUT,
        )


def _run_list(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    with SSH(desc) as ssh:
        state = cluster_users.show(desc, Slurm(desc, ssh))
    table = Table(title="users")
    for column in ("name", "uid", "account", "limits", "key"):
        table.add_column(column)
    for user in state.users:
        kind, _, rest = user.ssh_public_key.partition(" ")
        comment = rest.partition(" ")[2]
        table.add_row(user.name, str(user.uid), user.account, user.limits.describe(), f"{kind} {comment}".strip())
    out.print(table)
    if state.accounts:
        accounts = Table(title="accounts (all their members' jobs together)")
        for column in ("account", "limits"):
            accounts.add_column(column)
        for name, limits in sorted(state.accounts.items()):
            accounts.add_row(name, limits.describe())
        out.print(accounts)
    hosts = Table(title="hosts")
    for column in ("host", "list", "last applied", "errors"):
        hosts.add_column(column)
    for report in state.reports:
        current = "current" if report.digest == state.digest else "[yellow]older[/yellow]"
        age = f"{report.age_s:.0f} s ago" + ("" if report.fresh else " (off?)")
        hosts.add_row(report.host, current, age, "; ".join(report.errors))
    out.print(hosts)
    return 0
