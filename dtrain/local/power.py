"""Slurm's power saving on the local cluster: its SuspendProgram and ResumeProgram.

On Azure these deallocate and start scale-set instances (dtrain/remote/slurm/slurm_power.py). Here a
node is switched off by killing its sshd, the first process of the node's PID namespace, which
ends every process in it (slurmd, the Spot agent and job steps included); it is switched on by
starting the sshd again, and a slurmd and the Spot agent inside it, as `up` does
(dtrain/local/nodes.py). The network namespace stays, and so does its metadata endpoint.

slurmctld runs the wrappers that `up` writes to STATE/slurm/{suspend,resume,resume-fail} as root,
with a hostlist (`node-[0-1]`), from the head namespace; they run this module with the operator's
python, logging to STATE/logs/power.log:

    python -m dtrain.local.power --state-dir STATE suspend|resume|resume-fail node-[0-1]

`stop_node` and `start_node` are the same steps for one node, for tests that fail a node on purpose
(Slurm then marks it DOWN after SlurmdTimeout, and takes it back when its slurmd registers).
With a release mount (`up(release_mount=...)`, Lustre's stand-in), suspend first has the nodes release
it, with the Azure power program's own code (slurm_power.release_shared: the request in the node's
Slurm comment, its Spot agent's answer), and logs `deallocating NODES` (Azure's deallocate call) only then.
Every change to the cluster's record happens under its lock (dtrain/local/state.py).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dtrain.cli_entry import CLIParser, non_empty, run_cli
from dtrain.cluster.description import REPO_ROOT
from dtrain.errors import OperatorError
from dtrain.fileio import atomic_write
from dtrain.local import telemetry as local_telemetry
from dtrain.local.daemons import wait_port
from dtrain.local.nodes import (
    SSHD_WAIT_S,
    enter_node,
    node_roles,
    running_init_pid,
    spot_agent_role,
    start_slurmd,
    start_spot_agent,
    start_sshd,
    start_users_agent,
)
from dtrain.local.slurm_conf import POWER_ACTIONS, SlurmFiles, client_env, slurmd_role
from dtrain.local.state import LocalState, load_state, state_lock
from dtrain.processes import descendants, stop_pids
from dtrain.remote.slurm import slurm_power

LOG_NAME = "power.log"  # under STATE/logs
# How long suspend waits for the nodes to release the shared file system (Azure: 90 s); the agents read
# their comment every RELEASE_POLL_S (dtrain/local/nodes.py).
RELEASE_WAIT_S = 20
log = logging.getLogger("local-power")


def stop_node(state_dir: str | Path, node: str) -> None:
    """Switch the node off: SIGKILL its sshd and slurmd, and with them every process in it."""
    stop_nodes(state_dir, [node])


def start_node(state_dir: str | Path, node: str) -> None:
    """Switch the node on: its sshd, then its slurmd inside it (each unless it runs already)."""
    start_nodes(state_dir, [node])


def stop_nodes(state_dir: str | Path, nodes: Sequence[str]) -> None:
    state_dir = Path(state_dir).resolve()
    with state_lock(state_dir):
        state = _slurm_state(state_dir)
        targets = [state.node(node) for node in nodes]
        records = [state.record(role) for target in targets for role in node_roles(target.hostname)]
        pids = [pid for r in records if r is not None and r.alive() for pid in (r.pid, *descendants(r.pid))]
        # the sshd, PID 1 of its node, ignores SIGTERM; a machine switched off gets no warning either.
        # All nodes at once: each takes a second or more to end (the host's init reaps their zombies).
        stop_pids(pids, signals=(signal.SIGKILL,))
        for target in targets:
            target.stopped = True
        state.save()


def suspend_nodes(state_dir: Path, nodes: Sequence[str]) -> None:
    """Slurm's SuspendProgram: the nodes release the shared file system (where there is one to release),
    then go, as Azure's suspend deallocates them."""
    release = _slurm_state(state_dir).release_mount is not None
    if release:
        slurm_power.release_shared(list(nodes), RELEASE_WAIT_S, poll_s=0.2)
    log.info("deallocating %s", ",".join(nodes))
    stop_nodes(state_dir, nodes)
    if release:
        slurm_power.set_comment(list(nodes), "")  # as Azure's suspend does: the next boot finds no answer


def start_nodes(state_dir: str | Path, nodes: Sequence[str], requested_at: float | None = None) -> None:
    """requested_at: when slurmctld asked for the nodes (default: now)."""
    requested_at = time.time() if requested_at is None else requested_at
    state_dir = Path(state_dir).resolve()
    with state_lock(state_dir):
        state = _slurm_state(state_dir)
        targets = [state.node(node) for node in nodes]
        booting = [target for target in targets if running_init_pid(state, target) is None]
        for target in booting:
            start_sshd(state, target)
        for target in booting:
            log_file = state.logs / f"{target.hostname}.log"
            wait_port(target.address, target.ssh_port, SSHD_WAIT_S, f"sshd of {target.hostname}", log_file)
            # as Azure's dtrain-users.service, before slurmd: a person added meanwhile can run jobs there
            start_users_agent(state, target.hostname, enter_node(state, target))
        _wait_for_next_second(requested_at)
        for target in targets:
            slurmd = state.record(slurmd_role(target.hostname))
            if slurmd is None or not slurmd.alive():
                start_slurmd(state, target)
            agent = state.record(spot_agent_role(target.hostname))
            if agent is None or not agent.alive():
                start_spot_agent(state, target)
            local_telemetry.start_node(state, target)
            target.stopped = False
        state.save()


def _wait_for_next_second(asked_at: float) -> None:
    """Until the wall clock has left the second of the resume request. slurmctld takes a resumed
    node only once it reports a boot time (in whole seconds: its registration time less its uptime,
    rounded up) no earlier than the request's second; a slurmd (`-b`: booted when it started)
    that starts in a later second always does."""
    time.sleep(max(0.0, math.floor(asked_at) + 1 - time.time()))


def _slurm_state(state_dir: Path) -> LocalState:
    state = load_state(state_dir)
    if state is None:
        raise OperatorError(f"no local cluster recorded in {state_dir}")
    if state.slurm_conf is None:
        raise OperatorError(f"the local cluster in {state_dir} has no Slurm (localhost mode): no node to power")
    return state


def install_programs(files: SlurmFiles, state_dir: Path) -> None:
    """The wrappers slurm.conf names. slurmctld closes every descriptor before it runs them, and
    its environment is whatever `up` had: each wrapper sets up its output, path and interpreter."""
    q = shlex.quote
    power_log = state_dir / "logs" / LOG_NAME
    for action in POWER_ACTIONS:
        text = (
            "#!/bin/sh\n"
            f"# slurmctld runs this as root with a hostlist (node-[0-1]): {action} those nodes\n"
            f"exec >>{q(str(power_log))} 2>&1 </dev/null\n"
            f"cd {q(str(REPO_ROOT))} || exit 1\n"
            f"export PYTHONPATH={q(str(REPO_ROOT))} SLURM_CONF={q(str(files.conf))}\n"
            'export PATH="$PATH:/usr/sbin:/usr/bin:/sbin:/bin"\n'
            f'exec {q(sys.executable)} -m dtrain.local.power --state-dir {q(str(state_dir))} {action} "$@"\n'
        )
        atomic_write(files.power_program(action), text, 0o755)


def expand_hostlist(conf: str, hostlists: Sequence[str]) -> list[str]:
    """Slurm's hostlists (`node-[0-1],node-3`) as node names, expanded by Slurm itself."""
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", ",".join(hostlists)],
        env={**os.environ, **client_env(conf)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise OperatorError(f"scontrol cannot expand {','.join(hostlists)}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.split()


def _resume_failed(state_dir: Path, nodes: Sequence[str]) -> None:
    """Slurm gave up waiting for the nodes: switch off what did start, so that a later resume begins afresh."""
    log.warning("%s did not register within ResumeTimeout", ",".join(nodes))
    stop_nodes(state_dir, nodes)


def _run(args: argparse.Namespace) -> int:
    """Every outcome is one timestamped line of the power log (slurmctld itself only sees the status)."""
    requested_at = time.time()
    actions: dict[str, Callable[[Path, Sequence[str]], None]] = {
        "suspend": suspend_nodes,
        "resume": lambda where, names: start_nodes(where, names, requested_at),
        "resume-fail": _resume_failed,
    }
    try:
        state_dir = Path(args.state_dir).resolve()
        conf = _slurm_state(state_dir).slurm_conf
        assert conf is not None  # _slurm_state checked it
        nodes = expand_hostlist(conf, args.hostlists)
        actions[args.action](state_dir, nodes)
    except OperatorError as exc:
        log.error("%s %s failed: %s", args.action, ",".join(args.hostlists), exc)
        return int(exc.exit_code)
    log.info("%s %s: done", args.action, ",".join(nodes))
    return 0


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="python -m dtrain.local.power",
        description="Suspend or resume nodes of the local cluster (slurmctld's SuspendProgram and ResumeProgram).",
        epilog="example: python -m dtrain.local.power --state-dir STATE resume node-[0-1]",
    )
    parser.add_argument("--state-dir", type=non_empty, required=True, help="the local cluster's state directory")
    parser.add_argument("action", choices=POWER_ACTIONS, help="what to do with the nodes")
    parser.add_argument("hostlists", nargs="+", metavar="HOSTLIST", help="nodes, as Slurm names them: node-[0-1]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s", level=logging.INFO)
    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":  # slurmctld's entry point (through the wrappers), not the operator's
    sys.exit(main())
