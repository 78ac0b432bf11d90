"""The launcher against real sshd nodes of the local cluster (through the jump host), real Horovod over gloo."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from scripts import launch, local_cluster
from scripts.blobs import container_client
from scripts.cluster import NodeRecord, load
from scripts.daemons import free_port
from scripts.errors import OperatorError
from scripts.sshutil import SSH
from tests.polling import wait_for

from .conftest import (
    JOB,
    SESSION_SUBNET,
    address,
    cluster_name,
    host_pids_with,
    node_pids_with,
    run_module,
    start_module,
)

GHOST_ADDRESS = address(SESSION_SUBNET, 99)  # inside the session cluster's bridge range, no such host
NODE0, NODE1 = address(SESSION_SUBNET, 10), address(SESSION_SUBNET, 11)


@contextmanager
def ghost_node(cluster, hostname: str = "node-2"):
    """A registry entry whose node does not answer (it was deleted, or its network is down)."""
    record = NodeRecord(hostname=hostname, address=GHOST_ADDRESS, gpus=0, ib_state="absent", ready_at=datetime.now(UTC))
    path = local_cluster.write_registry_record(Path(cluster.node_registry_path), record)
    try:
        yield record
    finally:
        path.unlink()


def registry(cluster) -> list[NodeRecord]:
    with SSH(cluster) as ssh:
        records, notes = launch.read_registry(cluster, ssh)
    assert not notes
    return records


class Output:
    """Collects a running launcher's output lines in a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def has(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in self.lines)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def test_registry_and_preflight_table(cluster, tmp_path):
    data = Path(cluster.data_path) / "preflight-ds"
    (data / "train" / "n0").mkdir(parents=True, exist_ok=True)
    (data / "train" / "n0" / "a.JPEG").write_bytes(b"x")
    with ghost_node(cluster), SSH(cluster) as ssh:
        records = sorted(registry(cluster), key=lambda r: r.hostname)
        assert [r.hostname for r in records] == ["node-0", "node-1", "node-2"]
        ssh.set_nodes(records)
        started = time.time()
        results = launch.preflight(cluster, ssh, records, data_dir=str(data))
        assert time.time() - started < 30
        missing = launch.preflight(cluster, ssh, records[:1], data_dir=str(tmp_path / "no-such-dataset"))
    by_host = {r.hostname: r for r in results}
    for host in ("node-0", "node-1"):
        r = by_host[host]
        assert r.ok, r.problems
        assert (r.gpus, r.ib_state, r.shared, r.data, r.runtime) == (0, "absent", "present", "present", "host-ok")
        assert r.free_disk_gb and r.free_disk_gb > cluster.min_free_disk_gb
    assert not by_host["node-2"].ok and "unreachable" in by_host["node-2"].problems[0]
    assert not missing[0].ok and missing[0].problems == [f"dataset {tmp_path / 'no-such-dataset'} missing or empty"]

    console = Console(width=220, record=True)
    console.print(launch.preflight_table(results))
    table = console.export_text()
    for header in ("node", "GPUs", "IB", "shared FS", "data", "image/runtime", "free disk", "status"):
        assert header in table
    assert re.search(rf"node-0 .*{re.escape(NODE0)} .* 0 .* absent .* present .* present .* host-ok .* GB .* ok", table)
    assert re.search(rf"node-2 .*{re.escape(GHOST_ADDRESS)} .*unreachable", table)


def test_unhealthy_node_aborts_with_the_flag(cluster, tmp_path):
    with ghost_node(cluster):
        opts = launch.LaunchOptions(
            framework="pytorch", nodes=2, entrypoint=JOB, abort_on_unhealthy=True, runs_dir=tmp_path, upload=False
        )
        with pytest.raises(OperatorError, match=r"preflight failed \(--abort-on-unhealthy\): node-2: .*unreachable"):
            launch.launch(cluster, opts)
        opts.abort_on_unhealthy = False
        opts.nodes = 3
        with pytest.raises(OperatorError, match=r"only 2 healthy nodes, 3 needed \(node-2: .*unreachable"):
            launch.launch(cluster, opts)
    assert not list(tmp_path.iterdir())  # nothing started, nothing recorded


def test_two_node_job_prefixed_logs_exit_code_and_results(cluster, cluster_file, tmp_path):
    """A ghost node is excluded by preflight; the job runs on the two healthy ones and exits 3."""
    with ghost_node(cluster):
        proc = run_module(
            "scripts.launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2",
            "--entrypoint", JOB, "--runs-dir", str(tmp_path), "--run-id", "exit3", "--",
            "--steps", "3", "--exit-code", "3",
        )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "excluding unhealthy nodes: node-2" in out
    assert re.search(r"^\[0\|node-0\] hello from rank 0/2 on node-0 ", proc.stdout, re.M)
    assert re.search(r"^\[1\|node-1\] hello from rank 1/2 on node-1 ", proc.stdout, re.M)
    assert re.search(r"^\[1\|node-1\] step 2 sum 3$", proc.stdout, re.M)
    assert re.search(r"job failed: rank \d on node-\d exited with status 3", out)
    assert "Traceback" not in proc.stdout  # horovodrun's own traceback stays in the log file

    run_dir = tmp_path / "exit3"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["exit_code"] == 3 and record["world_size"] == 2
    assert [n["hostname"] for n in record["nodes"]] == ["node-0", "node-1"]
    assert record["metrics"]["world_size"] == 2 and record["metrics"]["hosts"] == ["node-0", "node-1"]
    assert (run_dir / "hostfile").read_text() == f"{NODE0} slots=1\n{NODE1} slots=1\n"
    assert "hello from rank 1/2 on node-1" in (run_dir / "logs" / "rank-1.log").read_text()
    assert "Traceback" in (run_dir / "launch.log").read_text()
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 3
    uploaded = {b.name for b in container_client(cluster.results).list_blobs(name_starts_with="exit3/")}
    assert {"exit3/run.json", "exit3/launch.log", "exit3/metrics.json", "exit3/logs/rank-0.log"} <= uploaded
    assert not host_pids_with("HVD_RUN_ID=exit3")


def start_long_job(cluster_file, runs_dir, run_id):
    """A 2-node launch that runs until something stops it, with its output captured."""
    proc = start_module(
        "scripts.launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--entrypoint", JOB,
        "--runs-dir", str(runs_dir), "--run-id", run_id, "--no-upload", "--", "--steps", "1000", "--sleep", "0.2",
    )  # fmt: skip
    return proc, Output(proc)


def test_sigint_stops_every_remote_process(cluster, cluster_file, tmp_path):
    run_id = "sigint"
    proc, out = start_long_job(cluster_file, tmp_path, run_id)
    try:
        wait_for(
            lambda: out.has(r"^\[0\|node-0\] step 1 ") and out.has(r"^\[1\|node-1\] step 1 "),
            120,
            what="steps",
            interval=0.1,
        )
        on_nodes = node_pids_with(cluster, f"HVD_RUN_ID={run_id}")
        assert on_nodes["node-0"] >= 2 and on_nodes["node-1"] >= 1  # horovodrun + rank 0; rank 1
        proc.send_signal(signal.SIGINT)
        started = time.time()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(5)
    assert proc.returncode == 130, out.text
    assert time.time() - started < 30
    assert "interrupted: stopping every process of the run on every node" in out.text
    assert node_pids_with(cluster, f"HVD_RUN_ID={run_id}") == {"node-0": 0, "node-1": 0}
    assert not host_pids_with(f"HVD_RUN_ID={run_id}")
    assert json.loads((tmp_path / run_id / "run.json").read_text())["interrupted"] is True


def test_killed_worker_fails_the_launch_names_the_host_and_leaves_nothing(cluster, cluster_file, tmp_path):
    run_id = "killed"
    proc, out = start_long_job(cluster_file, tmp_path, run_id)
    try:
        wait_for(lambda: out.has(r"^\[1\|node-1\] step 1 "), 120, what="rank 1 running", interval=0.1)
        # on node-1 itself, in its own process table: kill -9 the rank-1 worker
        kill = (
            "for d in /proc/[0-9]*; do grep -qxzF HVD_RUN_ID=killed $d/environ 2>/dev/null && "
            "grep -qxzF HOROVOD_RANK=1 $d/environ && grep -q hvd_job $d/cmdline && kill -9 ${d#/proc/} && echo ok; "
            "done; true"
        )
        with SSH(cluster, registry(cluster)) as ssh:
            assert ssh.run(ssh.node("node-1"), kill).stdout.split() == ["ok"]
        started = time.time()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(5)
    assert proc.returncode not in (0, 130), out.text
    assert time.time() - started < 60
    assert re.search(r"job failed: rank 1 on node-1 exited with status \d+", out.text)
    assert node_pids_with(cluster, f"HVD_RUN_ID={run_id}") == {"node-0": 0, "node-1": 0}
    assert not host_pids_with(f"HVD_RUN_ID={run_id}")
    record = json.loads((tmp_path / run_id / "run.json").read_text())
    assert (record["failed_rank"], record["failed_host"]) == (1, "node-1")


def test_node_missing_from_the_registry(cluster_file, tmp_path):
    started = time.time()
    proc = run_module(
        "scripts.launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--hosts", "node-0,node-7",
        "--wait-timeout", "3", "--runs-dir", str(tmp_path), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 4  # timed out waiting for the node
    assert "error: node-7 is not in the node registry" in proc.stderr and "(found: node-0, node-1;" in proc.stderr
    proc = run_module(
        "scripts.launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "3",
        "--wait-timeout", "3", "--runs-dir", str(tmp_path), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 4 and "only 2 of 3 nodes are ready" in proc.stderr
    assert time.time() - started < 60


def test_ssh_authentication_failure(cluster, tmp_path):
    wrong = tmp_path / "wrong_key"
    local_cluster.keygen(wrong, "not-authorized")
    desc = cluster.model_copy(update={"ssh_key": str(wrong)})
    path = desc.save(tmp_path / "cluster.json")
    started = time.time()
    proc = run_module("scripts.launch", "--cluster", str(path), "--framework", "pytorch", timeout=60)
    assert proc.returncode == 3  # the cluster refused us: environment, not input
    assert "SSH authentication failed for user 'root' with key" in proc.stderr
    assert "through the jump host" in proc.stderr
    assert time.time() - started < 60


def test_unreachable_jump_host_and_node(cluster, tmp_path):
    closed = free_port()
    jump = cluster.jump_host.model_copy(update={"port": closed})
    path = cluster.model_copy(update={"jump_host": jump}).save(tmp_path / "cluster.json")
    started = time.time()
    proc = run_module("scripts.launch", "--cluster", str(path), "--framework", "pytorch", timeout=60)
    assert proc.returncode == 3 and "unreachable (connection refused)" in proc.stderr
    with ghost_node(cluster, "node-2"), SSH(cluster) as ssh:
        ssh.set_nodes(registry(cluster))
        with pytest.raises(OperatorError, match=rf"node node-2 \(root@{re.escape(GHOST_ADDRESS)}\): unreachable"):
            ssh.run(ssh.node("node-2"), "true", timeout=30)
    assert time.time() - started < 60


def test_fallback_nodes_on_localhost_ports(tmp_path):
    """Where namespaces cannot be made: nodes are sshds on loopback addresses and ports; same launcher."""
    state = tmp_path / "fallback"
    desc = local_cluster.up(nodes=2, state_dir=state, name=cluster_name("l"), mode="localhost")
    try:
        assert local_cluster.load_state(state.resolve()).mode == "localhost"
        records = sorted(registry(desc), key=lambda r: r.hostname)
        assert [(r.address, r.ssh_port is not None) for r in records] == [("127.0.1.10", True), ("127.0.1.11", True)]
        opts = launch.LaunchOptions(
            framework="pytorch", entrypoint=JOB, job_args=["--steps", "2"], runs_dir=tmp_path / "runs", run_id="fb"
        )
        lines: list[str] = []
        result = launch.launch(load(state / "cluster.json"), opts, echo=lines.append)
        assert result.exit_code == 0, "\n".join(lines)
        assert any(line.startswith("[1|node-1] step 1 sum 3") for line in lines)
        assert result.metrics["world_size"] == 2
        assert result.results_url and result.results_url.endswith("/results/fb/")
    finally:
        local_cluster.down(state, quiet=True)
    assert not state.exists()


def test_the_jobs_own_verdict_names_the_rank_that_stopped_answering(tmp_path):
    # horovodrun blames the rank that exited first (the healthy rank 0, which noticed); the job's
    # own error line names the one that stopped answering, and the summary must carry it.
    streamer = launch.Streamer(tmp_path, ["node-0", "node-1"], echo=lambda line: None)
    for line in (
        "[1]<stdout>:step 5/8",
        "[0]<stderr>:error: rank 1 on host node-1 stopped answering (no reply within 5 s); rank 0 noticed",
        "Process 0 exit with status code 1.",
        "Process name: 0",
        "Exit code: 1",
    ):
        streamer.feed(line)
    streamer.close()
    result = launch.RunResult(run_id="r", exit_code=1, run_dir=tmp_path, nodes=["node-0", "node-1"], world_size=2)
    assert launch._job_exit(1, streamer, result, ["node-0", "node-1"], []) == 1
    assert result.message == (
        "job failed: rank 0 on node-0 exited with status 1: "
        "rank 1 on host node-1 stopped answering (no reply within 5 s); rank 0 noticed"
    )
