"""The flags of what a job asks Slurm for (--nodes, --gpus | --gpus-per-node, --exclusive, --time), shared by
`launch` and `alloc`, and the allocation they plan (dtrain/jobs/allocation.py). Runs on the operator's machine.
"""

from __future__ import annotations

import argparse

from dtrain.cli_entry import arg_type, int_between
from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm_time import check_time_limit
from dtrain.jobs.allocation import Allocation, plan_allocation


def add_allocation_arguments(parser: argparse.ArgumentParser) -> None:
    """--nodes, --gpus | --gpus-per-node, --exclusive, --time: what `launch` and `alloc` ask Slurm for."""
    parser.add_argument("--nodes", type=int_between(1), help="nodes to use (default: 1)")  # None: unset
    gpus = parser.add_mutually_exclusive_group()
    gpus.add_argument(
        "--gpus", type=int_between(1), metavar="N", help="GPUs in all, spread evenly over --nodes (one process each)"
    )
    gpus.add_argument(
        "--gpus-per-node",
        type=int_between(1),
        metavar="N",
        help="GPUs (processes) per node (default: every GPU of a node; 1 on CPU nodes)",
    )
    parser.add_argument(
        "--exclusive", action="store_true", help="whole nodes, even when the job asks for fewer GPUs than a node has"
    )
    parser.add_argument(
        "--time",
        "--time-limit",
        dest="time_limit",
        type=arg_type(check_time_limit),
        metavar="TIME",
        help="Slurm ends the job after this, in sbatch's --time syntax: 90 (minutes), 4:00:00, 2-00:00:00 "
        "(default: the cluster description's default_time_limit; at most its max_time_limit, the stack's maxJobTime)",
    )


def plan_from_args(desc: ClusterDescription, args: argparse.Namespace) -> Allocation:
    return plan_allocation(
        desc,
        nodes=args.nodes,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        exclusive=args.exclusive,
        time_limit=args.time_limit,
    )
