"""Real Slurm on the local cluster: munged, slurmctld in the head namespace, a slurmd per node,
driven from the host with the Slurm commands and SLURM_CONF, as the operator CLI will drive them."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import pytest

from dtrain.errors import ExitCode, OperatorError
from dtrain.local import cluster as local_cluster
from dtrain.local import network as local_network
from dtrain.local import nodes as local_nodes
from dtrain.local import power as local_power
from dtrain.local import slurm as local_slurm
from dtrain.local import slurm_conf
from dtrain.local.nodes import running_init_pid
from dtrain.local.state import LocalState, NodeState
from infra.contract import SLURM_PARTITION, SPOT_PARTITION

from .conftest import (
    SESSION_SUBNET,
    address,
    cluster_name,
    free_subnet,
    live_pids_mentioning,
    local_state_dir,
    own_cluster,
    run_module,
)
from .conftest import slurm_command as slurm  # a Slurm command on this machine, as the description says

T = TypeVar("T")


def wait_for(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    """probe's first true answer, polled until timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        answer = probe()
        if answer:
            return answer
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def node_states(desc) -> dict[str, str]:
    return local_slurm.node_states(Path(desc.slurm.conf))


def report(path: Path, since: float = 0) -> dict[str, str] | None:
    """A node's health report (key=value lines), if there is one from a check made since `since`."""
    if not path.exists():
        return None
    found = dict(line.split("=", 1) for line in path.read_text().splitlines())
    checked_at = datetime.strptime(found["checked_at"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    return found if checked_at >= int(since) else None  # checked_at: whole seconds


def test_description_names_the_controller_and_partition(cluster):
    assert cluster.slurm is not None
    assert cluster.slurm.partition == SLURM_PARTITION
    assert (cluster.slurm.controller_host, cluster.slurm.controller_address) == ("head", address(SESSION_SUBNET, 2))
    assert cluster.slurm.login == cluster.jump_host and Path(cluster.slurm.conf).is_file()
    ping = slurm(cluster, "scontrol", "ping")
    assert ping.returncode == 0 and "Slurmctld(primary) at head is UP" in ping.stdout
    nodes = slurm(cluster, "sinfo", "--noheader", "--Node", "--format=%N %P %T %c")
    # every node is in the default partition and, locally, in the Spot one too (dtrain/local/metadata.py)
    assert sorted(nodes.stdout.splitlines()) == [
        f"node-{i} {partition} idle 2" for i in (0, 1) for partition in (f"{SLURM_PARTITION}*", SPOT_PARTITION)
    ]


def test_partitions_have_the_descriptions_time_limits_as_slurm_reads_them(cluster):
    """The renderer's DefaultTime and MaxTime, read back from the running slurmctld."""
    assert (cluster.default_time_limit, cluster.max_time_limit) == ("1:00:00", "INFINITE")
    limits = slurm(cluster, "sinfo", "--noheader", "--format=%P %L %l")  # partition, default, max
    assert sorted(limits.stdout.split("\n")[:-1]) == [
        f"{SLURM_PARTITION}* 1:00:00 infinite",
        f"{SPOT_PARTITION} 1:00:00 infinite",
    ], limits.stderr


def test_a_job_above_the_partitions_max_time_is_refused_when_submitted(cluster):
    """EnforcePartLimits: an sbatch by hand above MaxTime fails at once instead of pending for ever."""
    partitions = (SLURM_PARTITION, SPOT_PARTITION)
    for partition in partitions:
        assert slurm(cluster, "scontrol", "update", f"partitionname={partition}", "maxtime=2:00:00").returncode == 0
    try:
        both = f"--partition={SPOT_PARTITION},{SLURM_PARTITION}"  # as launch --spot-fallback names them
        for extra in ([], [both]):
            refused = slurm(cluster, "sbatch", *extra, "--time=3:00:00", "--output=/dev/null", "--wrap=true")
            assert refused.returncode != 0 and "time limit" in refused.stderr.lower(), refused.stdout
        accepted = slurm(cluster, "sbatch", "--wait", "--time=1:00:00", "--output=/dev/null", "--wrap=true")
        assert accepted.returncode == 0, accepted.stderr
    finally:
        for partition in partitions:
            slurm(cluster, "scontrol", "update", f"partitionname={partition}", "maxtime=infinite")


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
    monkeypatch.setattr(local_slurm, "READY_TIMEOUT_S", 0)  # Slurm never counts as ready
    state, name = tmp_path / "never-ready", cluster_name("n")
    with pytest.raises(OperatorError, match=r"Slurm nodes not idle within 0s: node-0"):
        local_cluster.up(nodes=1, state_dir=state, name=name, subnet=free_subnet())
    assert not state.exists() and live_pids_mentioning(str(state)) == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{name}-" not in namespaces


def test_local_conf_has_power_saving_in_seconds_and_the_health_check(tmp_path):
    files = slurm_conf.SlurmFiles(tmp_path)
    nodes = ["node-0", "node-1"]
    settings = slurm_conf.LocalSlurmSettings(autostop_s=3, health_check_interval_s=2)
    conf = slurm_conf.render_local_conf(files, "t", "10.213.9.2", nodes, settings).splitlines()
    for action, key in (
        ("suspend", "SuspendProgram"),
        ("resume", "ResumeProgram"),
        ("resume-fail", "ResumeFailProgram"),
    ):
        assert f"{key}={tmp_path}/slurm/{action}" in conf
    assert {"SuspendTime=3", "SuspendTimeout=5", "HealthCheckInterval=2", "SlurmdTimeout=10", "KillWait=30"} <= set(
        conf
    )
    assert f"HealthCheckProgram={files.health_check}" in conf and not any(
        line.startswith("SuspendExcParts") for line in conf
    )
    assert "SlurmctldParameters=enable_configless,idle_on_node_suspend,cloud_reg_addrs,power_save_interval=2" in conf
    # Slurm 22.05 here: what 23.11 does for cloud nodes by default, asked for; no cgroup process tracking
    assert {"PrivateData=cloud", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none"} <= set(conf)
    # autostop 0: the partition is never suspended (and the power programs are still there to resume)
    never = slurm_conf.render_local_conf(files, "t", "10.213.9.2", nodes, slurm_conf.LocalSlurmSettings())
    assert f"SuspendExcParts={SLURM_PARTITION}" in never.splitlines() and "HealthCheckInterval=60" in never


def test_override_replaces_in_place_and_appends_the_rest():
    conf = "# SlurmUser=comment\nSlurmUser=slurm\nTaskPlugin=task/affinity\n"
    assert slurm_conf.override(conf, {"SlurmUser": "root", "MailProg": "/bin/true"}) == (
        "# SlurmUser=comment\nSlurmUser=root\nTaskPlugin=task/affinity\n"
        "# the local cluster's own settings\nMailProg=/bin/true\n"
    )


def node_pids(state: LocalState, node: NodeState) -> list[int]:
    """What runs in a node's namespace but its metadata endpoint: the emulated platform's, which stays
    when the node is switched off (dtrain/local/metadata.py)."""
    endpoint = state.record(f"metadata-{node.hostname}")
    return [pid for pid in local_network.namespace_pids(str(node.namespace)) if endpoint is None or pid != endpoint.pid]


def test_autostop_suspends_idle_nodes_and_a_job_resumes_them(tmp_path):
    with own_cluster(tmp_path, "a", autostop_seconds=3) as desc:
        state_dir = local_state_dir(desc)
        # idle for 3 s: Slurm runs the SuspendProgram, the nodes are powered down ("~")
        wait_for(lambda: all(s == "idle~" for s in node_states(desc).values()), 60, "both nodes idle~")
        state = local_cluster.load_state(state_dir)
        assert all(node.stopped for node in state.nodes)
        for node in state.nodes:  # switched off: no slurmd, no sshd, nothing in the node
            assert node_pids(state, node) == [], node.hostname
        info = local_cluster.status(state_dir)
        stopped = {c["component"] for c in info["components"] if c["state"] == "stopped"}
        nodes = ("node-0", "node-1")
        roles = ("slurmd", "spot-agent", "node-exporter", "users")  # dtrain/local/accounts.py
        assert stopped == {*nodes, *(f"{role}-{node}" for node in nodes for role in roles)}
        assert info["up"]

        # a job that needs both: the ResumeProgram starts them, and the job runs; each node, started
        # again, sees its own "NVMe" directory at the one local path, as before it was suspended
        for node in state.nodes:
            (local_nodes.node_nvme_dir(state, node.hostname) / "owner").write_text(node.hostname)
        local = local_nodes.local_data_dir(state)
        started = time.time()
        proc = slurm(desc, "srun", "--nodes=2", "sh", "-c", f'echo "$(hostname):$(cat {local}/owner)"', timeout=90)
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.split()) == ["node-0:node-0", "node-1:node-1"] and time.time() - started < 30
        state = local_cluster.load_state(state_dir)
        assert not any(node.stopped for node in state.nodes)
        log = (state_dir / "logs" / "power.log").read_text()
        # Slurm may suspend or resume the two in one call or in two (a loaded machine): each once at least
        for action in ("suspend", "resume"):
            handled = {node for nodes in re.findall(rf"{action} (\S+): done", log) for node in nodes.split(",")}
            assert handled >= {"node-0", "node-1"}, log

        # a node the program does not know: a clear error in the log, a failure for slurmctld
        wrapper = slurm_conf.SlurmFiles(state_dir).power_program("resume")
        assert subprocess.run([str(wrapper), "node-9"]).returncode == ExitCode.BAD_INPUT
        assert (
            "ERROR resume node-9 failed: no node 'node-9' in the local cluster"
            in (state_dir / "logs" / "power.log").read_text()
        )
    # own_cluster: `down` left no process, namespace, link or file


def test_a_node_switched_off_is_powered_down_through_slurm_and_started_again_for_a_job(tmp_path):
    """A node switched off behind Slurm's back (an eviction nothing on it saw): its slurmd stops answering,
    the head node's reconcile (dtrain/local/reconcile.py) finds it off and powers it down through Slurm,
    and a job that needs it makes Slurm start it again, instead of it staying DOWN."""
    with own_cluster(tmp_path, "f") as desc:
        state_dir = local_state_dir(desc)
        local_power.stop_node(state_dir, "node-1")
        node = local_cluster.load_state(state_dir).node("node-1")
        assert node.stopped and node_pids(local_cluster.load_state(state_dir), node) == []
        # SlurmdTimeout (10 s) and slurmctld's next ping make it DOWN; the reconcile then acts within 5 s
        wait_for(
            lambda: node_states(desc)["node-1"].startswith("idle~ (spot eviction or stop outside Slurm"),
            90,
            "node-1 powered down through Slurm",
        )
        assert node_states(desc)["node-0"] == "idle"
        assert "node-1 lost by Slurm" in (state_dir / "logs" / "reconcile.log").read_text()

        proc = slurm(desc, "srun", "--nodes=2", "hostname", timeout=120)
        assert proc.returncode == 0 and sorted(proc.stdout.split()) == ["node-0", "node-1"], proc.stderr


def test_health_check_drains_a_node_whose_shared_directory_is_hidden(tmp_path):
    with own_cluster(tmp_path, "h", health_check_interval_s=2) as desc:
        shared, state_dir = Path(desc.shared_mount_path), local_state_dir(desc)
        reports = shared / ".health"
        node_0 = wait_for(lambda: report(reports / "node-0"), 20, "a report of node-0")
        assert (node_0["node"], node_0["ok"], node_0["shared"], node_0["reason"]) == ("node-0", "1", "ok", "")
        state = local_cluster.load_state(state_dir)
        init = running_init_pid(state, state.node("node-1"))
        in_node_1 = ["nsenter", f"--target={init}", "--mount"]
        # node-1 alone sees an empty, read-only directory where the shared file system was
        subprocess.run([*in_node_1, "mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(shared)], check=True)
        try:
            drained = wait_for(
                lambda: (s := node_states(desc)["node-1"]).startswith("drained") and s, 30, "node-1 drained"
            )
            assert drained == f"drained (health-check: {shared} missing or not writable)"
            # the other node still runs jobs; its report (from the host's side) says it is fine
            proc = slurm(desc, "srun", "--nodes=1", "--nodelist=node-0", "hostname")
            assert proc.returncode == 0 and proc.stdout.split() == ["node-0"], proc.stderr
            assert report(reports / "node-0")["ok"] == "1"  # type: ignore[index]
            # the operator's view: `status` names the drained node and why, and exits 0 (node-0 takes jobs)
            # wide enough that the reason (a temporary path, longer under pytest-xdist) is not wrapped
            shown = run_module("dtrain", "status", "--cluster", str(state_dir / "cluster.json"), env={"COLUMNS": "400"})
            assert shown.returncode == 0, shown.stderr
            assert re.search(rf"node-1\s.*drained.*health-check: {re.escape(str(shared))}", shown.stdout), shown.stdout
            assert "1 drained" in shown.stdout and "1 idle" in shown.stdout
        finally:
            subprocess.run([*in_node_1, "umount", str(shared)], check=True)
        unhidden = time.time()
        # the next check passes: the node is resumed, and its report is written again
        wait_for(lambda: node_states(desc)["node-1"] == "idle", 30, "node-1 resumed")
        node_1 = wait_for(lambda: report(reports / "node-1", since=unhidden), 10, "a new report of node-1")
        assert (node_1["node"], node_1["ok"], node_1["shared"], node_1["reason"]) == ("node-1", "1", "ok", "")
        assert (reports / "node-1").stat().st_mode & 0o777 == 0o644
