"""`cluster from-stack|show|for-user`: write the cluster description from a Pulumi stack, print it, or write
a person's own from the admin's. The description itself (the seam every command reads) is
dtrain/cluster/description.py; this module is the verb's parser and handlers. Runs on the operator's machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dtrain.checks import check_directory
from dtrain.cli_entry import add_cluster_option, arg_type, non_empty
from dtrain.cluster.description import (
    REPO_ROOT,
    check_image_tag,
    check_outside_repository,
    check_person_name,
    check_private_key,
    default_ssh_key,
    for_user,
    from_pulumi_stack,
    load,
    user_config_dir,
)
from dtrain.cluster.slurm_time import check_time_limit
from dtrain.errors import OperatorError, explain_os_error
from infra.slurm_time import DEFAULT_JOB_TIME

CLUSTER_DESCRIPTION_TEXT = """\
The cluster description is the JSON file every other command reads: hosts and SSH access, the
shared file system, blob storage, Slurm and the job runtime. `local up` writes one for the local
cluster; `cluster from-stack` writes one from an Azure stack's outputs."""
FROM_STACK_TEXT = """\
Read `pulumi stack output --json --show-secrets` of a stack and write the cluster description
(mode 0600 in a 0700 directory: it holds the read-only data SAS). It goes to your config directory,
never into this repository (refused there: git or `images` could carry the SAS away). Needs the
Pulumi CLI, logged in to the stack's backend."""
FROM_STACK_EXAMPLES = """\
examples:
  python -m dtrain cluster from-stack --stack dev      # -> ~/.config/azure-horovod/cluster-dev.json
  python -m dtrain cluster from-stack --stack dev --runtime host --ssh-key ~/.ssh/azure_key
  python -m dtrain cluster from-stack --stack dev --default-time 4:00:00   # jobs without --time: 4 hours
  export CLUSTER_DESCRIPTION=~/.config/azure-horovod/cluster-dev.json   # every command reads it from then on
"""
FOR_USER_TEXT = """\
Write the description a person of the cluster's users list (`dtrain users add`) works with, from the
admin's (--cluster): their name on every host and their own private key. On Azure a person can also
write their own: `cluster from-stack --stack STACK --user NAME --ssh-key THEIR_KEY`."""
FOR_USER_EXAMPLES = """\
examples:
  python -m dtrain cluster for-user alice --ssh-key /home/alice/.ssh/id_ed25519 -o /home/alice/cluster.json
  python -m dtrain cluster from-stack --stack dev --user alice --ssh-key ~/.ssh/id_ed25519   # as alice, on Azure
"""
CLUSTER_EXAMPLES = """\
examples:
  python -m dtrain cluster from-stack --stack dev
  python -m dtrain cluster show --cluster ~/.config/azure-horovod/cluster-dev.json
"""
SHOW_EXAMPLES = """\
examples:
  python -m dtrain cluster show                        # $CLUSTER_DESCRIPTION, else the local cluster's
  python -m dtrain cluster show --cluster ~/.config/azure-horovod/cluster-dev.json
  python -m dtrain cluster show --field data_path      # one value, bare: where staged datasets are
  python -m dtrain launch --framework pytorch -- --data imagenet --data-dir "$(python -m dtrain cluster show \\
      --field data_path)/mini" --steps 20
"""


def configure(commands: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = commands.add_parser(
        "cluster",
        help="write a cluster description from a Pulumi stack, or show one",
        description=CLUSTER_DESCRIPTION_TEXT,
        epilog=CLUSTER_EXAMPLES,
        formatter_class=raw,
    )
    sub = parser.add_subparsers(required=True)
    stack = sub.add_parser(
        "from-stack",
        help="write a description from a Pulumi stack's outputs",
        description=FROM_STACK_TEXT,
        epilog=FROM_STACK_EXAMPLES,
        formatter_class=raw,
    )
    _from_stack_arguments(stack)
    stack.set_defaults(handler=_from_stack)
    show = sub.add_parser(
        "show",
        help="print a description with its secrets masked",
        description="Print the cluster description as JSON, every secret replaced by ***; with --field, one\n"
        "value of it (a text bare, anything else as JSON), for scripts and for command lines that need it.",
        epilog=SHOW_EXAMPLES,
        formatter_class=raw,
    )
    add_cluster_option(show)
    show.add_argument(
        "--field",
        type=non_empty,
        metavar="NAME",
        help="print only this field; a dotted NAME reaches inside one (slurm.partition, data.container)",
    )
    show.set_defaults(handler=_show)
    person = sub.add_parser(
        "for-user",
        help="write a person's description from the admin's (their name and key on every host)",
        description=FOR_USER_TEXT,
        epilog=FOR_USER_EXAMPLES,
        formatter_class=raw,
    )
    person.add_argument(
        "user", type=arg_type(check_person_name), metavar="NAME", help="the person's name in the cluster's users list"
    )
    person.add_argument("--ssh-key", required=True, type=non_empty, metavar="FILE", help="the person's private key")
    person.add_argument(
        "-o",
        "--output",
        type=non_empty,
        metavar="FILE",
        help=f"file to write, outside this repository (default: {user_config_dir()}/CLUSTER-NAME.json)",
    )
    add_cluster_option(person)
    person.set_defaults(handler=_for_user)


def _from_stack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stack", required=True, type=non_empty, metavar="NAME", help="Pulumi stack name")
    parser.add_argument(
        "--ssh-key",
        type=non_empty,
        metavar="FILE",
        default=default_ssh_key(),
        help="private key of the stack's admin user, or with --user your own (default: %(default)s)",
    )
    parser.add_argument(
        "--user",
        type=arg_type(check_person_name),
        metavar="NAME",
        help="your name in the cluster's users list (`dtrain users`): the description works as you, with your "
        "own key (default: the admin user's description)",
    )
    parser.add_argument(
        "--runtime",
        choices=("docker", "host"),
        default="docker",
        help="jobs run in the framework images (docker, the default) or in /opt/hvd-venv on the nodes (host)",
    )
    parser.add_argument(
        "--image-tag",
        type=arg_type(check_image_tag),
        metavar="TAG",
        default="latest",
        help="tag of the framework images, as `images` printed it (default: latest)",
    )
    parser.add_argument(
        "--default-time",
        type=arg_type(check_time_limit),
        metavar="TIME",
        help="time limit of a job that names none, in Slurm's --time syntax, at most the stack's maxJobTime "
        f"(default: the stack's defaultJobTime, {DEFAULT_JOB_TIME} unless configured)",
    )
    parser.add_argument(
        "--known-hosts",
        type=non_empty,
        metavar="FILE",
        help="known_hosts file for this cluster (default: ~/.ssh/known_hosts.STACK)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=non_empty,
        metavar="FILE",
        help=f"file to write, outside this repository (default: {user_config_dir()}/cluster-STACK.json)",
    )
    parser.add_argument(
        "--cwd",
        type=non_empty,
        default=str(REPO_ROOT),
        metavar="DIR",
        help="Pulumi project directory (default: this repository)",
    )


def _from_stack(args: argparse.Namespace) -> int:
    key = check_private_key(args.ssh_key)
    if args.output:
        output = Path(args.output).expanduser()
        if output.is_dir():
            raise OperatorError(f"--output {output} is a directory: pass a file name")
        check_outside_repository(output, "--output")
        check_directory(output.parent, "the directory of --output")
    else:
        suffix = f"-{args.user}" if args.user else ""
        output = user_config_dir() / f"cluster-{args.stack}{suffix}.json"
        make_private_directory(output.parent)
    desc = from_pulumi_stack(
        args.stack,
        key,
        cwd=args.cwd,
        known_hosts=args.known_hosts,
        runtime=args.runtime,
        image_tag=args.image_tag,
        default_time_limit=args.default_time,
    )
    if args.user:
        desc = for_user(desc, args.user, key)
    print(f"wrote {desc.save(output)} (mode 0600: it holds the read-only data SAS)")
    print(f"use it with: export CLUSTER_DESCRIPTION={output}")
    return 0


def _for_user(args: argparse.Namespace) -> int:
    key = check_private_key(args.ssh_key)
    desc = for_user(load(args.cluster), args.user, key)
    output = Path(args.output).expanduser() if args.output else user_config_dir() / f"{desc.name}-{args.user}.json"
    if output.is_dir():
        raise OperatorError(f"--output {output} is a directory: pass a file name")
    check_outside_repository(output, "--output")
    make_private_directory(output.parent)
    print(f"wrote {desc.save(output)} (mode 0600: it holds the cluster's data credential)")
    print(f"give it to {args.user} with their key; they use it with: export CLUSTER_DESCRIPTION=FILE")
    return 0


def make_private_directory(path: Path) -> None:
    """Create the config directory only its owner can enter (an existing one keeps its mode)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise explain_os_error(exc, "create the config directory") from None


def _show(args: argparse.Namespace) -> int:
    shown = load(args.cluster).masked()
    if args.field:
        shown = field_of(shown, args.field)
    print(shown if isinstance(shown, str) else json.dumps(shown, indent=2))
    return 0


def field_of(document: dict[str, Any], name: str) -> Any:
    """The value at a dotted field name (`slurm.partition`), or a usage error naming the fields there are."""
    value: Any = document
    parts = name.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the description"
        if not isinstance(value, dict):
            raise OperatorError(f"--field {name}: {where} is {json.dumps(value)}, which has no fields")
        if part not in value:
            raise OperatorError(f"--field {name}: {where} has no {part!r} (its fields: {', '.join(value)})")
        value = value[part]
    return value
