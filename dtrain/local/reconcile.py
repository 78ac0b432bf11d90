"""The head node's reconcile of lost nodes, on the local cluster: a daemon that `local up` starts on the host.

On Azure, slurm-power-reap.timer runs `slurm-power reap` on the head node every 5 minutes
(dtrain/remote/slurm/slurm_power.py); among other things it asks the scale set for the power state of
each node that Slurm lost (DOWN or not responding) and powers the deallocated ones down through
Slurm, which then starts them again for the next job. A Spot eviction that the node's agent missed
leaves a node that way. Here the same decision code (slurm_power.reconcile_lost) runs every few
seconds, with the node's power state read from the cluster's record instead of Resource Manager: a
node whose sshd (its first process) no longer runs was switched off (dtrain/local/metadata.py's
platform evicts that way). Every outcome is a line of STATE/logs/reconcile.log.

  python -m dtrain.local.reconcile --state-dir STATE [--every 5]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtrain.cli_entry import CLIParser, int_between, non_empty, run_cli
from dtrain.errors import OperatorError
from dtrain.local.nodes import running_init_pid
from dtrain.local.state import LocalState, load_state
from dtrain.remote.slurm import slurm_power

ROLE = "reconcile"  # its record in the cluster's state, and its log's name
INTERVAL_S = 5  # the Azure timer's 5 minutes, scaled to the local cluster's 10 s SlurmdTimeout
log = logging.getLogger("local-reconcile")


def instance_view(state: LocalState, node: str) -> dict[str, Any]:
    """What Azure's instance view would say of a local node: deallocated once it was switched off."""
    try:
        running = running_init_pid(state, state.node(node)) is not None
    except OperatorError as exc:
        raise slurm_power.PowerError(str(exc)) from None
    return {"statuses": [{"code": f"PowerState/{'running' if running else 'deallocated'}"}]}


def reconcile_once(state_dir: Path) -> list[str]:
    """The nodes Slurm lost that were switched off, powered down through Slurm; returns them. The
    cluster's record is read at most once a round, for the first node Slurm has lost."""

    @functools.cache
    def recorded() -> LocalState:
        state = load_state(state_dir)
        if state is None:
            raise slurm_power.PowerError(f"no local cluster recorded in {state_dir}")
        return state

    return slurm_power.reconcile_lost(slurm_power.slurm_nodes(), lambda node: instance_view(recorded(), node))


def _run(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir).resolve()
    state = load_state(state_dir)
    if state is None or state.slurm_conf is None:
        raise OperatorError(f"no local cluster with Slurm recorded in {state_dir}")
    os.environ["SLURM_CONF"] = state.slurm_conf  # for scontrol, which slurm_power runs
    while True:
        try:
            reconcile_once(state_dir)
        except Exception:  # slurmctld restarting, a node switched meanwhile: the next round tries again
            log.exception("reconcile failed")
        time.sleep(args.every)


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="python -m dtrain.local.reconcile",
        description="Power down, through Slurm, the local nodes that Slurm lost and that were switched off.",
        epilog="example: python -m dtrain.local.reconcile --state-dir STATE",
    )
    parser.add_argument("--state-dir", type=non_empty, required=True, help="the local cluster's state directory")
    parser.add_argument(
        "--every", type=int_between(1), default=INTERVAL_S, help="seconds between two rounds (%(default)s)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s", level=logging.INFO)
    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":  # `local up` starts it; it runs until `local down` stops it
    raise SystemExit(main())
