"""Slurm on the local cluster, started: Debian's slurmctld, slurmd and munged, run the way the Azure
cluster runs them, with the slurm.conf that infra/cloud_init/slurm.py renders for Azure (its files and
the daemons' command lines: dtrain/local/slurm_conf.py). Runs on the operator's machine, as root;
`local up` (dtrain/local/cluster.py) calls `prepare`, then `start` once the nodes' sshds run.

  munged     on the host; its socket is a file under the state directory. The namespaces share the
             host's file system, so every daemon and client reaches it by that path (slurm.conf's
             AuthInfo names it).
  slurmctld  in its own network namespace, the head node (`<name>-head`, hostname `head`, the
             subnet's second address): each cluster has its own port 6817, and the nodes reach the
             controller at an address on the bridge, as on Azure.
  slurmdbd   beside it, with MariaDB (dtrain/local/accounting.py): every job's record, for `sacct`.
  slurmd     in each node's namespaces, those of its sshd (network, hostname, process table,
             mounts): a node is one machine, and `ps` over SSH shows its job steps.
Commands from the host: `SLURM_CONF=STATE/slurm/slurm.conf sinfo` (`slurm_conf.client_env`).

Power saving is Slurm's own: after `autostop_s` idle seconds slurmctld runs STATE/slurm/suspend,
and STATE/slurm/resume when a job needs the node again (dtrain/local/power.py stops and starts the
node's sshd and slurmd). Timeouts are seconds here, where Azure's are minutes.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dtrain.cluster.description import REPO_ROOT
from dtrain.errors import ExitCode, OperatorError
from dtrain.local import accounting as local_accounting
from dtrain.local import accounts as local_accounts
from dtrain.local import gpus as local_gpus
from dtrain.local import power as local_power
from dtrain.local import reconcile as local_reconcile
from dtrain.local import slurm_conf
from dtrain.local.daemons import log_tail, wait_port, wait_socket_file
from dtrain.local.nodes import start_daemon, start_slurmd, start_spot_agent
from dtrain.local.state import LocalState
from infra.contract import SLURMCTLD_PORT

READY_TIMEOUT_S = 60  # from slurmctld's start until every node has shown idle


def prepare(state: LocalState, settings: slurm_conf.LocalSlurmSettings) -> None:
    """Slurm's files, munged, then MariaDB and slurmdbd in the head namespace with the cluster's associations:
    slurmctld refuses its first start without slurmdbd, and runs no job without them."""
    files = slurm_conf.SlurmFiles(Path(state.state_dir))
    head, names = state.head, [node.hostname for node in state.nodes]
    assert head is not None and head.namespace  # netns mode wires the head first
    files.make_dirs(names)
    shared = Path(state.state_dir) / "shared"
    slurm_conf.write_config(files, state.slurm_cluster_name, head.address, names, shared, settings)
    if settings.gpus_per_node:
        local_gpus.configure(files, settings.gpus_per_node)
    local_power.install_programs(files, Path(state.state_dir))
    state.slurm_conf = str(files.conf)
    local_accounting.write_config(state, files, head.address)
    start_daemon(state, "munged", slurm_conf.munged_argv(files), str(files.munge_socket))
    local_accounting.create_database(state)
    wait_socket_file(files.munge_socket, 20, "munged", state.logs / "munged.log")
    local_accounting.start(state, files, users=[getpass.getuser()])


def start(state: LocalState) -> None:
    """slurmctld in the head namespace, a slurmd on every node (their sshds run); returns once all are idle."""
    files = slurm_conf.SlurmFiles(Path(state.state_dir))
    head, names = state.head, [node.hostname for node in state.nodes]
    assert head is not None and head.namespace
    etc = local_accounts.etc_dir(state, local_accounts.LOGIN_HOST)
    start_daemon(state, "slurmctld", slurm_conf.slurmctld_argv(head.namespace, files.conf, etc), str(files.conf))
    wait_port(head.address, SLURMCTLD_PORT, 30, "slurmctld", state.logs / "slurmctld.log")
    for node in state.nodes:
        start_slurmd(state, node)
        start_spot_agent(state, node)
    # the head node's periodic reconcile (on Azure: slurm-power-reap.timer) of nodes Slurm lost
    module = [sys.executable, "-m", "dtrain.local.reconcile", "--state-dir", state.state_dir]
    start_daemon(state, local_reconcile.ROLE, ["env", f"PYTHONPATH={REPO_ROOT}", *module], "dtrain.local.reconcile")
    wait_until_idle(files.conf, names, READY_TIMEOUT_S, state.logs)


# --- readiness ---------------------------------------------------------------------------------
def node_states(conf: Path) -> dict[str, str]:
    """node -> its state as sinfo prints it (idle, idle~, down*, drained, ...), with the reason if any."""
    proc = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"],
        env={**os.environ, **slurm_conf.client_env(conf)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise OperatorError(f"sinfo failed: {(proc.stderr or proc.stdout).strip()}", ExitCode.NOT_READY)
    states = {}
    for line in proc.stdout.splitlines():
        node, state, reason = line.split("|", 2)
        states[node] = state if reason in ("", "none") else f"{state} ({reason})"
    return states


def wait_until_idle(conf: Path, nodes: Sequence[str], timeout: float, logs: Path) -> None:
    """Until sinfo has shown every node idle (once: with a short SuspendTime, a node may be
    suspended again before the last one registers); on timeout, name each other node with its
    slurmd log."""
    deadline = time.time() + timeout
    states: dict[str, str] = {}
    seen_idle: set[str] = set()
    problem = ""
    while time.time() < deadline:
        try:
            states, problem = node_states(conf), ""
        except (OperatorError, subprocess.TimeoutExpired) as exc:
            problem = f" ({exc})"
        seen_idle.update(node for node in nodes if states.get(node) == "idle")
        if seen_idle.issuperset(nodes):
            return
        time.sleep(0.2)
    late = [node for node in nodes if node not in seen_idle]
    details = "".join(
        f"\n{node}: {states.get(node, 'unknown to slurmctld')}{log_tail(logs / f'{slurm_conf.slurmd_role(node)}.log')}"
        for node in late
    )
    raise OperatorError(
        f"Slurm nodes not idle within {timeout:.0f}s: {', '.join(late)}{problem}{details}", ExitCode.TIMED_OUT
    )
