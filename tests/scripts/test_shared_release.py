"""The shared file system released before a node goes, on the local cluster (sharedStorage lustre): each node
mounts a stand-in for Lustre (a tmpfs in its own mount namespace) with a writer on it, and the order on a
suspend and on a Spot eviction is writers stopped, unmounted, then the deallocation. The suspend runs
Azure's own request code (slurm_power.release_shared) and logs `deallocating` where Azure's calls Resource
Manager; the release is the nodes' real Spot agent running the real release program."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from dtrain.local import metadata as local_metadata
from dtrain.local import power as local_power
from dtrain.local.nodes import enter_node, spot_agent_role
from dtrain.local.state import LocalState, load_state
from dtrain.remote.slurm import slurm_power
from tests.polling import wait_for

from .conftest import local_state_dir, own_cluster, slurm_command

# A suspend: the agent reads its comment within its poll, releases in about a second, and the power program
# waits RELEASE_WAIT_S at most for that; the rest is Slurm's power-save interval and a loaded machine.
SUSPEND_S = local_power.RELEASE_WAIT_S + 60
# An eviction: the agent acts at once, within Azure's notice, and Slurm then powers the node down.
EVICTION_S = local_metadata.PREEMPT_NOTICE_S + 60


def stand_in(state: LocalState, node: str, mount: Path, pids: Path) -> subprocess.Popen[bytes]:
    """A tmpfs at the release mount inside the node, and a writer appending to a file there (inside the node's
    process table, where its agent looks); the writer's pid as the node sees it goes to pids/<node>."""
    enter = enter_node(state, state.node(node))
    subprocess.run([*enter, "mount", "-t", "tmpfs", "lustre-standin", str(mount)], check=True)
    writer = f'echo $$ >"{pids / node}"; exec 3>>"{mount}/checkpoint"; while :; do echo step >&3; sleep 0.05; done'
    return subprocess.Popen([*enter, "sh", "-c", writer])


def agent_release(state: LocalState, node: str) -> dict:
    """The release program's summary, as the node's agent logged it."""
    log = (state.logs / f"{spot_agent_role(node)}.log").read_text()
    found = re.findall(r"shared release of \S+: exit 0, (\{.*\})", log)
    return json.loads(found[-1]) if found else {}


def power_log(state: LocalState) -> list[str]:
    path = state.logs / local_power.LOG_NAME
    return path.read_text().splitlines() if path.exists() else []


def line_of(lines: list[str], text: str) -> int:
    return next(index for index, line in enumerate(lines) if text in line)


def test_writers_are_stopped_and_the_mount_released_before_a_suspend_and_an_eviction_deallocate(tmp_path):
    mount, pids = tmp_path / "lustre", tmp_path / "pids"
    pids.mkdir()
    with own_cluster(tmp_path, "r", release_mount=mount) as desc:
        state_dir = local_state_dir(desc)
        state = load_state(state_dir)
        assert state is not None and state.release_mount == str(mount)
        writers = {node: stand_in(state, node, mount, pids) for node in ("node-0", "node-1")}
        wait_for(lambda: all((pids / node).exists() for node in writers), 30, "the writers to start")

        # a suspend (autostop, or the reaper's power down): Slurm runs the SuspendProgram
        slurm_command(desc, "scontrol", "update", "nodename=node-1", "state=power_down")
        wait_for(lambda: any("deallocating node-1" in line for line in power_log(state)), SUSPEND_S, "node-1 to go")
        released = agent_release(state, "node-1")
        assert int((pids / "node-1").read_text()) in released["writers"], released
        assert released["unmounted"] and released["flushed"]
        assert released["at"]["writers_stopped"] <= released["at"]["flushed"] <= released["at"]["unmounted"]
        lines = power_log(state)
        asked = line_of(lines, f"node-1: shared file system {slurm_power.RELEASED}")
        assert asked < line_of(lines, "deallocating node-1"), lines
        assert writers["node-1"].wait(timeout=30) is not None

        # a Spot eviction: the agent releases within the notice, before it has Slurm power the node down
        event = local_metadata.announce_preempt(state_dir, "node-0")
        wait_for(lambda: any("deallocating node-0" in line for line in power_log(state)), EVICTION_S, "node-0 to go")
        released = agent_release(state, "node-0")
        assert int((pids / "node-0").read_text()) in released["writers"] and released["unmounted"], released
        agent_log = (state.logs / f"{spot_agent_role('node-0')}.log").read_text()
        assert agent_log.index("shared release of") < agent_log.index(f"acknowledged {event}")
        lines = power_log(state)
        answered = line_of(lines, "node-0: shared file system released before it was asked")
        assert answered < line_of(lines, "deallocating node-0"), lines
        assert writers["node-0"].wait(timeout=30) is not None
