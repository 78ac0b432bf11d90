"""`drain NODE [--requeue] [--reason TEXT]`, `drain NODE --undo`: take a node out of scheduling (and its jobs off it).

What an operator does about a node whose rank `jobs` and `status` name slow (docs/operator.md, "Slow ranks"):
Slurm drains it (no new job starts there), and with --requeue each job running on it is requeued: Slurm ends
it and queues it again with its id, and it starts on other nodes from its newest checkpoint. A requeued job
is held back for two minutes (BeginTime), time for its epilog on the old nodes; once Slurm has let it off
them, the hold is lifted. --undo resumes the node. Through the login node, as `status` and `cancel` reach
Slurm; the admin's rights (root; sudo for the admin user on Azure).
"""

from __future__ import annotations

import argparse
import re
import time

from dtrain.cli_entry import add_cluster_option, arg_type, non_empty
from dtrain.cluster.description import load
from dtrain.cluster.slurm import Slurm, patiently
from dtrain.cluster.ssh import SSH
from dtrain.errors import ExitCode, OperatorError
from dtrain.ui import make_console

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # a host name: Slurm's NodeName of our nodes
LEAVE_WAIT_S = 90.0  # how long a requeued job may take to leave its nodes (KillWait, then the epilog)
console = make_console()


def check_node_name(text: str) -> str:
    if not NODE_NAME.fullmatch(text):
        raise OperatorError(f"{text!r} is not a node name (`dtrain status` lists them)")
    return text


def configure(commands: argparse._SubParsersAction) -> None:
    drain = commands.add_parser(
        "drain",
        help="take a node out of scheduling (a slow or failing one); --requeue moves its jobs, --undo resumes it",
        description="Drain NODE in Slurm: no new job starts on it, and the jobs running there go on unless "
        "--requeue ends them and queues them again, to restart on other nodes from their newest checkpoint (a "
        "job launched without --requeue cannot be: it is named, and it ends where it runs). `status` shows the "
        "node drained, with the reason. --undo resumes it. Needs the cluster admin's rights.",
        epilog="examples: python -m dtrain drain node-1 --requeue; python -m dtrain drain node-1 --reason 'slow "
        "GPU, RMA 123'; python -m dtrain drain node-1 --undo. A job that could not be requeued makes it exit 1 "
        "(the node is drained all the same).",
    )
    drain.add_argument("node", type=arg_type(check_node_name), metavar="NODE", help="the node, as `status` names it")
    what = drain.add_mutually_exclusive_group()
    what.add_argument(
        "--requeue", action="store_true", help="also requeue the jobs running on it (they resume from a checkpoint)"
    )
    what.add_argument("--undo", action="store_true", help="resume the node: it takes jobs again")
    drain.add_argument(
        "--reason",
        type=arg_type(non_empty),
        help="why, as `status` shows it (default: 'drained by <your user>: slow rank')",
    )
    add_cluster_option(drain)
    drain.set_defaults(handler=run_drain)


def run_drain(args: argparse.Namespace) -> int:
    if args.undo and args.reason:
        raise OperatorError("--reason is for draining: --undo resumes the node")
    desc = load(args.cluster)
    ssh = SSH(desc)
    slurm = Slurm(desc, ssh)
    with ssh:
        nodes = {node.name: node for node in patiently(slurm.nodes, "about the nodes")}
        if args.node not in nodes:
            raise OperatorError(
                f"no node {args.node} in cluster {desc.name} (its nodes: {', '.join(sorted(nodes)) or 'none'})"
            )
        if args.undo:
            return _resume(slurm, args.node, nodes[args.node].state)
        reason = args.reason or f"drained by {desc.ssh_user}: slow rank"
        patiently(lambda: slurm.drain(args.node, reason), f"to drain {args.node}")
        console.print(f"{args.node} drained ({reason}): no new job starts on it", markup=False)
        jobs = patiently(lambda: slurm.running_on(args.node), f"about the jobs on {args.node}")
        if not args.requeue:
            for job in jobs:
                console.print(f"job {job} still runs on {args.node}: `drain {args.node} --requeue` moves it")
            return 0
        refused = {job: why for job in jobs if (why := slurm.requeue(job)) is not None}
        for job in jobs:
            if job not in refused:
                _restart_elsewhere(slurm, job, args.node)
    if refused:
        said = "; ".join(f"job {job}: {why}" for job, why in refused.items())
        raise OperatorError(
            f"{args.node} is drained, but Slurm did not requeue {', '.join(refused)} ({said}): a job launched "
            "without --requeue has no checkpoints to resume from; it ends where it runs (`dtrain cancel` it and "
            "launch it again with --requeue)",
            ExitCode.FAILED,
        )
    return 0


def _resume(slurm: Slurm, node: str, state: str) -> int:
    if "drain" not in state and "down" not in state:
        console.print(f"{node} is not drained ({state}): nothing to undo")
        return 0
    patiently(lambda: slurm.resume_node(node), f"to resume {node}")
    console.print(f"{node} resumed: it takes jobs again")
    return 0


def _restart_elsewhere(slurm: Slurm, job: str, node: str) -> None:
    """Wait until the requeued job has left its nodes (pending again), then lift Slurm's hold on it."""
    deadline = time.monotonic() + LEAVE_WAIT_S
    state = patiently(lambda: slurm.job_state(job), f"about job {job}")
    while state not in (None, "PENDING") and time.monotonic() < deadline:
        time.sleep(0.5)
        state = patiently(lambda: slurm.job_state(job), f"about job {job}")
    if state == "PENDING":
        patiently(lambda: slurm.start_now(job), f"to start job {job}")
        console.print(f"job {job} requeued off {node}: it restarts from its newest checkpoint as nodes allow")
    elif state is None:
        console.print(f"job {job} ended before it could be requeued")
    else:
        console.print(
            f"job {job} requeued off {node}, but Slurm still has it {state} after {LEAVE_WAIT_S:.0f} s: it "
            "restarts once its nodes let it go (two minutes after the requeue at most)"
        )
