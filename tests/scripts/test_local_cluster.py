"""The embedded local cluster: what `up` creates, what `status` says, that `down` leaves nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dtrain.cluster.description import load
from dtrain.cluster.ssh import SSH
from dtrain.errors import OperatorError
from dtrain.local import cluster as local_cluster
from dtrain.local import mlflow_server as local_mlflow

from .conftest import SESSION_SUBNET, address, cluster_name, free_subnet, leftovers, links, namespaces, run_module


def test_up_status_down_leaves_nothing(tmp_path, capsys):
    state, name, subnet = tmp_path / "lc", cluster_name("c"), free_subnet()
    a10, a11 = address(subnet, 10), address(subnet, 11)
    up = run_module(
        "dtrain", "local", "up", "--state-dir", str(state), "--nodes", "2", "--name", name, "--subnet", subnet,
        timeout=120,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    recorded = local_cluster.load_state(state.resolve())
    try:
        # not the description the other commands read by default: `up` says how to point them at it, and
        # where a staged dataset lands, which a job's --data-dir names
        described = state.resolve() / "cluster.json"
        assert f"  export CLUSTER_DESCRIPTION={described}   # or --cluster {described}" in up.stderr, up.stderr
        assert f"puts NAME at {state.resolve()}/shared/data/NAME (a job's --data-dir)" in up.stderr
        # its SSH key and SASs stay out of git even where the state directory is inside a checkout
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        untracked = subprocess.run(
            ["git", "-C", str(tmp_path), "status", "--porcelain", "--untracked-files=all"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert untracked.stdout == "" and (state / "cluster.json").is_file()
        desc = load(state / "cluster.json")
        assert recorded.mode == "netns" and [n.address for n in recorded.nodes] == [a10, a11]
        assert {f"{name}-node-0", f"{name}-node-1"} <= set(namespaces()) and f"{name}-br" in links()
        assert Path(f"/etc/netns/{name}-node-1/hosts").read_text().splitlines()[-1] == f"{a11}\tnode-1"
        # no node registry: Slurm knows the nodes; jobs upload results with the results SAS
        assert not (state / "shared" / "nodes").exists()
        assert desc.results_upload.kind == "sas" and desc.results_upload.secret == desc.results.credential.secret
        assert desc.blob_pull[1].endswith("dtrain/remote/boot/blob_pull.py") and Path(desc.blob_pull[1]).is_file()
        assert (state / "shared" / ".health").stat().st_mode & 0o777 == 0o755
        # each node: its own hostname, address, /etc/hosts and process table, reached through the jump host
        with SSH(desc, addresses={"node-1": a11}) as ssh:
            probe = "hostname; ip -4 -o addr show eth0; getent hosts node-0; ls -d /proc/[0-9]* | wc -l"
            out = ssh.run(ssh.node("node-1"), probe)
        hostname, addr, hosts, procs = out.stdout.strip().splitlines()
        assert hostname == "node-1" and f"{a11}/24" in addr and hosts.split()[0] == a10
        # only this node's sshd, its users' loop (dtrain/local/accounts.py) and our session, not the host's
        assert int(procs) < 12
        assert (state / "cluster.json").stat().st_mode & 0o077 == 0
        # MLflow comes up after `up` returns: alive but not answering, it shows as starting, and says so
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(local_mlflow, "wait_until_answers", lambda uri, timeout_s: False)
            early = local_cluster.status(state)
            local_cluster.print_status(early)
        assert [c["state"] for c in early["components"] if c["component"] == "mlflow"] == ["starting"]
        assert "starting: MLflow does not answer yet" in capsys.readouterr().out
        assert early["up"]  # starting is not down
        assert local_mlflow.wait_until_answers(str(desc.tracking_uri), 90)
        # --state-dir before the action works as well as after it
        status = run_module("dtrain", "local", "--state-dir", str(state), "status")
        # 4 sshds, Azurite, munged, MariaDB, slurmdbd, slurmctld, 2 slurmds, 2 Spot agents, 2 metadata
        # endpoints, the reconcile of lost nodes, 2 node_exporters, Prometheus, the MLflow server, the users'
        # loops of the head, the NFS server and 2 nodes; 3 namespaces (the head and the nodes)
        assert status.returncode == 0 and "azurite" in status.stdout, status.stdout
        assert status.stdout.count("running") == 27, status.stdout
        assert f"{recorded.head.address}:6819" in status.stdout  # slurmdbd, where sacct reaches it
        assert f"slurm: SLURM_CONF={state.resolve()}/slurm/slurm.conf sinfo" in status.stdout
        roles = {p.role for p in recorded.processes}
        expected = {"munged", "slurmctld", "slurmd-node-0", "slurmd-node-1", "spot-agent-node-0", "metadata-node-1"}
        expected |= {"mlflow", "mariadb", "slurmdbd"}
        assert expected <= roles
        assert all(p.alive() for p in recorded.processes)
    finally:
        down = run_module("dtrain", "local", "down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert not any(p.alive() for p in recorded.processes)
    # slurmd, slurmctld, munged, sshd, Azurite, namespaces, links, files: all gone
    assert leftovers(state, name) == []
    assert not Path(f"/etc/netns/{name}-node-0").exists()
    gone = run_module("dtrain", "local", "status", "--state-dir", str(state))
    assert gone.returncode == 3 and "no local cluster" in gone.stdout


def test_up_refuses_a_range_in_use_and_cleans_up(cluster_dir, tmp_path):
    state = tmp_path / "clash"
    with pytest.raises(OperatorError, match=rf"subnet {SESSION_SUBNET} is already in use"):
        local_cluster.up(nodes=1, state_dir=state, name=cluster_name("x"), subnet=SESSION_SUBNET)
    name = cluster_name("x")
    assert not state.exists() and f"{name}-" not in links() and f"{name}-node-0" not in namespaces()


def test_up_twice_is_refused(cluster_dir):
    with pytest.raises(OperatorError, match="already recorded"):
        local_cluster.up(nodes=1, state_dir=cluster_dir, name=cluster_name("y"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--autostop-seconds", "-1"], "argument --autostop-seconds: must be a whole number >= 0, got '-1'"),
        (["--health-check-interval", "0"], "argument --health-check-interval: must be a whole number between 1"),
    ],
)
def test_up_refuses_bad_power_and_health_flags(tmp_path, flags, message):
    state = tmp_path / "never"
    proc = run_module("dtrain", "local", "up", "--state-dir", str(state), *flags, timeout=60)
    assert proc.returncode == 2 and f"error: {message}" in proc.stderr and "Traceback" not in proc.stderr
    assert not state.exists()


def test_up_refuses_autostop_without_slurm(tmp_path):
    with pytest.raises(OperatorError, match="--autostop-seconds needs Slurm, which is not run in localhost mode"):
        local_cluster.up(
            nodes=1, state_dir=tmp_path / "lh", name=cluster_name("z"), mode="localhost", autostop_seconds=5
        )
    with pytest.raises(OperatorError, match="--health-check-interval must be between 1 and 86400 seconds, got 0"):
        local_cluster.up(nodes=1, state_dir=tmp_path / "lh", name=cluster_name("z"), health_check_interval_s=0)
    assert not (tmp_path / "lh").exists()
