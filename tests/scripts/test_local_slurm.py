"""Real Slurm on the local cluster: munged, slurmctld in the head namespace, a slurmd per node,
driven from the host with the Slurm commands and SLURM_CONF, as the operator CLI will drive them."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from infra.contract import SLURM_PARTITION
from scripts import local_cluster, local_slurm
from scripts.cluster import ClusterDescription
from scripts.errors import ExitCode, OperatorError

from .conftest import SESSION_SUBNET, address, cluster_name, free_subnet, live_pids_mentioning


def slurm(desc: ClusterDescription, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A Slurm command on this machine (the local cluster's login host), as the description says."""
    assert desc.slurm is not None and desc.slurm.conf
    env = {**os.environ, **local_slurm.client_env(desc.slurm.conf)}
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)


def test_description_names_the_controller_and_partition(cluster):
    assert cluster.slurm is not None
    assert cluster.slurm.partition == SLURM_PARTITION
    assert (cluster.slurm.controller_host, cluster.slurm.controller_address) == ("head", address(SESSION_SUBNET, 2))
    assert cluster.slurm.login == cluster.jump_host and Path(cluster.slurm.conf).is_file()
    ping = slurm(cluster, "scontrol", "ping")
    assert ping.returncode == 0 and "Slurmctld(primary) at head is UP" in ping.stdout
    nodes = slurm(cluster, "sinfo", "--noheader", "--Node", "--format=%N %P %T %c")
    assert nodes.stdout.split("\n")[:2] == [f"node-0 {SLURM_PARTITION}* idle 2", f"node-1 {SLURM_PARTITION}* idle 2"]


def test_srun_reaches_both_nodes(cluster):
    proc = slurm(cluster, "srun", "--nodes=2", "hostname")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["node-0", "node-1"]


def test_sbatch_runs_a_two_node_job_inside_the_nodes(cluster):
    out = Path(cluster.shared_mount_path) / "runs" / f"slurm-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    script = out / "job.sh"
    # each task writes its node's hostname, and the first process of the machine it runs on: the
    # node's sshd, when slurmd shares the node's process table
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes=2 --ntasks-per-node=1 --output={out}/job-%j.out\n"
        f"srun bash -c 'echo \"$(hostname) $(cat /proc/1/comm)\" > {out}/$(hostname).txt'\n"
    )
    proc = slurm(cluster, "sbatch", "--wait", "--parsable", str(script))
    assert proc.returncode == 0, proc.stderr + (out / f"job-{proc.stdout.strip()}.out").read_text()
    job = proc.stdout.strip().split(";")[0]
    assert [(out / f"node-{i}.txt").read_text() for i in (0, 1)] == ["node-0 sshd\n", "node-1 sshd\n"]
    # no accounting storage here: the controller's own record of the finished job is the check
    shown = slurm(cluster, "scontrol", "show", "job", job, "--oneliner").stdout
    assert re.search(r"JobState=COMPLETED .*ExitCode=0:0", shown) and "NodeList=node-[0-1]" in shown
    assert slurm(cluster, "squeue", "--noheader", f"--jobs={job}").stdout.strip() == ""


def test_waiting_for_idle_names_the_node_that_is_not(cluster, cluster_dir):
    conf = Path(cluster.slurm.conf)
    assert slurm(cluster, "scontrol", "update", "nodename=node-1", "state=drain", "reason=under-test").returncode == 0
    try:
        with pytest.raises(OperatorError) as raised:
            local_slurm.wait_until_idle(conf, ["node-0", "node-1"], timeout=1, logs=cluster_dir / "logs")
    finally:
        slurm(cluster, "scontrol", "update", "nodename=node-1", "state=resume")
    message = str(raised.value)
    assert raised.value.exit_code == ExitCode.TIMED_OUT
    assert message.startswith("Slurm nodes not idle within 1s: node-1\n") and "node-1: drained (under-test)" in message
    assert f"--- {cluster_dir / 'logs' / 'slurmd-node-1.log'} (last lines) ---" in message
    local_slurm.wait_until_idle(conf, ["node-0", "node-1"], timeout=30, logs=cluster_dir / "logs")


def test_failed_up_stops_every_slurm_daemon(tmp_path, monkeypatch):
    monkeypatch.setattr(local_cluster, "SLURM_READY_TIMEOUT_S", 0)  # Slurm never counts as ready
    state, name = tmp_path / "never-ready", cluster_name("n")
    with pytest.raises(OperatorError, match=r"Slurm nodes not idle within 0s: node-0"):
        local_cluster.up(nodes=1, state_dir=state, name=name, subnet=free_subnet())
    assert not state.exists() and live_pids_mentioning(str(state)) == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{name}-" not in namespaces


def test_override_replaces_in_place_and_appends_the_rest():
    conf = "# SlurmUser=comment\nSlurmUser=slurm\nTaskPlugin=task/affinity\n"
    assert local_slurm.override(conf, {"SlurmUser": "root", "MailProg": "/bin/true"}) == (
        "# SlurmUser=comment\nSlurmUser=root\nTaskPlugin=task/affinity\n"
        "# the local cluster's own settings\nMailProg=/bin/true\n"
    )
