"""`local up|down|status|link-rate|preempt`: the verb's parser and handlers; the embedded local cluster they
start, stop and show is dtrain/local/cluster.py. With `demo`, the only way the verbs reach dtrain/local/.
Runs on the operator's machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dtrain.cli_entry import arg_type, int_between, non_empty
from dtrain.cluster.description import DEFAULT_DESCRIPTION, DEFAULT_LOCAL_STATE
from dtrain.errors import ExitCode
from dtrain.local import link as local_link
from dtrain.local import metadata as local_metadata
from dtrain.local.cluster import (
    DEFAULT_NAME,
    DEFAULT_SUBNET,
    MAX_HEALTH_CHECK_INTERVAL_S,
    MAX_NODES,
    NAME_ENV,
    SUBNET_ENV,
    TRAIN_PYTHON,
    check_name,
    down,
    parse_subnet,
    print_status,
    set_link_rate,
    status,
    up,
)
from dtrain.ui import make_console

console = make_console()

DESCRIPTION = """\
The embedded local cluster: the Azure cluster's topology on this machine. Every node is a network
namespace with its own hostname, sshd and slurmd; slurmctld runs in a head namespace; Azurite
stands in for blob storage; STATE_DIR/shared is the shared file system. Needs root for the
namespaces (without it: --mode localhost, sshds on loopback ports and no Slurm).

`up` writes STATE_DIR/cluster.json, the description every other command reads by default; with
another --state-dir, point them at it (export CLUSTER_DESCRIPTION=STATE_DIR/cluster.json, or --cluster),
and give the other `local` commands the same --state-dir. The state directory ignores itself in git.
"""
EXAMPLES = """\
examples:
  python -m dtrain local up --nodes 2                       # then: launch, jobs, logs, ...
  python -m dtrain local up --autostop-seconds 300          # idle nodes are suspended after 5 min
  python -m dtrain local status                             # exit 0 when everything runs
  python -m dtrain local preempt node-0                     # a Spot eviction of node-0 in 30 s
  python -m dtrain local down                               # stops and removes all of it
"""


def configure(commands: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter  # the examples keep their lines
    parser = commands.add_parser(
        "local",
        help="the embedded local cluster: up, status, down, preempt",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=raw,
    )
    _add_state_dir(parser, top_level=True)
    actions = parser.add_subparsers(dest="command", metavar="command", required=True)
    p_up = actions.add_parser(
        "up",
        help="create the cluster and write STATE_DIR/cluster.json",
        description="Create the local cluster (namespaces, sshds, Slurm, Azurite) and write its description,\n"
        "STATE_DIR/cluster.json. Anything that fails on the way is removed again.",
        epilog="example:\n  python -m dtrain local up --nodes 2 --autostop-seconds 60\n",
        formatter_class=raw,
    )
    _add_up_arguments(p_up)
    p_up.set_defaults(handler=_run_up)
    p_down = actions.add_parser(
        "down",
        help="stop and remove everything `up` created",
        description="Stop every process of the local cluster, remove its namespaces and links, and STATE_DIR.",
        epilog="example:\n  python -m dtrain local down --state-dir /tmp/lc\n",
        formatter_class=raw,
    )
    p_status = actions.add_parser(
        "status",
        help="what is running (exit 0 when everything is up, 3 when not)",
        description="Every process and namespace of the local cluster, where it listens, and whether it runs.\n"
        "Nodes that Slurm powered down show as stopped, and are no failure.",
        epilog="example:\n  python -m dtrain local status\n",
        formatter_class=raw,
    )
    p_rate = actions.add_parser(
        "link-rate",
        help="slow the links between the nodes (tc tbf), or give them full speed again",
        description="Limit what each node (or --node alone) sends over its eth0 to RATE (tc tbf on the veth),\n"
        "on the running cluster; `full` removes the limit. Traffic inside a node keeps its speed. Needs\n"
        "--mode netns.",
        epilog="examples:\n  python -m dtrain local link-rate 100mbit\n  python -m dtrain local link-rate full\n"
        "  python -m dtrain local link-rate 20mbit --node node-1   # one slow node\n",
        formatter_class=raw,
    )
    p_rate.add_argument("rate", help="a tc rate such as 100mbit, 1gbit, 512kbit; or full")
    p_rate.add_argument("--node", help="this node only (default: every node)")
    p_preempt = actions.add_parser(
        "preempt",
        help="announce a Spot eviction of a node (Azure's Scheduled Events Preempt)",
        description="Announce that Azure evicts NODE in --notice seconds: its metadata endpoint lists a Preempt,\n"
        "its Spot agent checkpoints and requeues the node's jobs, and the node is switched off once the\n"
        "agent acknowledges the event or the notice runs out. Prints the event's id.",
        epilog="examples:\n  python -m dtrain local preempt node-0\n"
        "  python -m dtrain local preempt node-1 --notice 1\n",
        formatter_class=raw,
    )
    p_preempt.add_argument("node", help="the node to evict (a node of the cluster: node-0, node-1, ...)")
    p_preempt.add_argument(
        "--notice",
        type=int_between(1, 3600),
        default=local_metadata.PREEMPT_NOTICE_S,
        help="seconds before the eviction (%(default)s, Azure's minimum)",
    )
    subs = ((p_down, _run_down), (p_status, _run_status), (p_rate, _run_link_rate), (p_preempt, _run_preempt))
    for sub, handler in subs:
        _add_state_dir(sub)
        sub.set_defaults(handler=handler)


def _add_state_dir(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    """--state-dir before the action (`local --state-dir D up`) or after it (`local up --state-dir D`)."""
    parser.add_argument(
        "--state-dir",
        type=non_empty,
        default=str(DEFAULT_LOCAL_STATE) if top_level else argparse.SUPPRESS,
        help=f"where the cluster's state lives (default {DEFAULT_LOCAL_STATE})",
    )


def _add_up_arguments(parser: argparse.ArgumentParser) -> None:
    _add_state_dir(parser)
    parser.add_argument("--nodes", type=int_between(1, MAX_NODES), default=2, help="how many nodes (%(default)s)")
    parser.add_argument(
        "--name",
        type=arg_type(check_name),
        default=os.environ.get(NAME_ENV) or DEFAULT_NAME,
        help=f"prefix of namespaces and interfaces (%(default)s; ${NAME_ENV} sets the default)",
    )
    parser.add_argument(
        "--subnet",
        type=arg_type(parse_subnet),
        default=os.environ.get(SUBNET_ENV) or DEFAULT_SUBNET,
        help=f"private range for the nodes (%(default)s; ${SUBNET_ENV} sets the default)",
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "netns", "localhost"),
        default="auto",
        help="netns: namespaces and Slurm (needs root); localhost: sshds on loopback, no Slurm; auto: netns "
        "where allowed (%(default)s)",
    )
    parser.add_argument(
        "--train-python", type=non_empty, help=f"python of the training environment (default {TRAIN_PYTHON})"
    )
    parser.add_argument(
        "--autostop-seconds",
        type=int_between(0),
        default=0,
        help="idle seconds before Slurm suspends a node (stops its slurmd and sshd); a job that needs it "
        "starts it again. 0: never (%(default)s)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int_between(0, 8),
        default=0,
        help="emulated GPUs per node: Slurm gres with device files, each job isolated to its own (task/cgroup "
        "ConstrainDevices); needs the cgroup v1 devices controller (%(default)s)",
    )
    parser.add_argument(
        "--storage-dir",
        type=non_empty,
        help="where Azurite keeps the blobs (datasets, results, kept checkpoints); outside the state directory "
        "they outlive `down`, and a new cluster with the same --storage-dir finds them (default: in the state "
        "directory)",
    )
    parser.add_argument(
        "--health-check-interval",
        type=int_between(1, MAX_HEALTH_CHECK_INTERVAL_S),
        default=60,
        help="seconds between two runs of the node health check, which drains a failing node (%(default)s)",
    )
    parser.add_argument(
        "--link-rate",
        type=arg_type(local_link.parse_link_rate),
        help="slow each node's link to this rate with tc (e.g. 100mbit; default: full speed); "
        "change it later with `local link-rate`",
    )


def _run_up(args: argparse.Namespace) -> int:
    desc = up(
        args.nodes,
        args.state_dir,
        args.name,
        args.subnet,
        args.mode,
        args.train_python,
        autostop_seconds=args.autostop_seconds,
        health_check_interval_s=args.health_check_interval,
        link_rate=args.link_rate,
        gpus_per_node=args.gpus_per_node,
        storage_dir=args.storage_dir,
    )
    where = Path(args.state_dir).resolve() / "cluster.json"
    console.print(f"local cluster up: {desc.node_count} nodes; description {where}")
    for line in next_steps(where, desc.data_path, args.state_dir):
        console.print(line, highlight=False, soft_wrap=True)
    return 0


def next_steps(description: Path, data_path: str, state_dir: str) -> list[str]:
    """What to know before the next command: where a staged dataset lands (a job's --data-dir), and, for a
    cluster whose description the other commands would not read by default, how to point them at it."""
    lines = [f"datasets: `stage all DIR --dataset NAME` puts NAME at {data_path}/NAME (a job's --data-dir)"]
    default = Path(os.environ.get("CLUSTER_DESCRIPTION") or DEFAULT_DESCRIPTION).expanduser()
    if default.resolve() != description:
        lines += [
            f"the other commands read {default}: use this cluster with",
            f"  export CLUSTER_DESCRIPTION={description}   # or --cluster {description} on each command",
            f"  (`local status`, `local down` and the other `local` commands take --state-dir {state_dir})",
        ]
    return lines


def _run_down(args: argparse.Namespace) -> int:
    down(args.state_dir)
    return 0


def _run_link_rate(args: argparse.Namespace) -> int:
    rate = set_link_rate(args.state_dir, args.rate, args.node)
    whose = f"of {args.node}" if args.node else "between nodes"
    console.print(f"link rate {whose}: {rate or local_link.FULL_SPEED}")
    return 0


def _run_preempt(args: argparse.Namespace) -> int:
    print(local_metadata.preempt(args.state_dir, args.node, args.notice))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    info = status(args.state_dir)
    print_status(info)
    return 0 if info["up"] else ExitCode.NOT_READY
