"""The gate before multi-node jobs (dtrain/jobs/node_gate.py), on a three-node cluster of its own.

A two-node job starts while one node's link is slowed (`local link-rate --node`): the gate measures that
node, the job requeues itself, the node's Epilog drains it with its figure and lifts Slurm's two-minute
hold, and the job runs again on the two healthy nodes and finishes. The log, run.json and node_exporter's
textfile directory say which node was left out and why. On Azure jobs run as their user, not root: a
person's job may make itself requeueable and requeue itself, as the gate's lines do. (Here the gated
job is the admin's: a person cannot run this machine's training interpreter, which lives under /root.)
The verdict's rules are checked on their own first."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.cluster.description import load
from dtrain.local import cluster as local_cluster
from dtrain.local.nodes import keygen
from dtrain.local.slurm_conf import TELEMETRY
from dtrain.remote.job.node_gate import verdict
from infra.health_thresholds import LOCAL_HEALTH
from tests.polling import wait_for

from .conftest import cluster_name, free_subnet, leftovers, run_module, slurm_command

SLOW = "2mbit"  # 0.25 MB/s: a quarter of the local threshold (infra/health_thresholds.py)
JOB = "import time; time.sleep(1); print('trained', flush=True)\n"
# what node_gate.requeue_lines runs, as a person's own job: the first attempt requeues itself
REQUEUE_ITSELF = """import os, subprocess
if "SLURM_RESTART_COUNT" not in os.environ:
    job = os.environ["SLURM_JOB_ID"]
    subprocess.run(["scontrol", "update", f"jobid={job}", "requeue=1"], check=True)
    subprocess.run(["scontrol", "requeue", job], check=True)
    print("requeued", flush=True)
"""
# two attempts, each with torch's import on loaded nodes, the gate and the upload; the requeue's hold is lifted
JOB_DONE_S = 600
REQUEUE_HOLD_S = 121  # how long Slurm holds a requeued job back (EligibleTime), unless lifted


def figures(link_gbs: float, node_value: float = 20.0, node: str = "n") -> dict:
    return {"node": node, "node_figure": "matmul", "node_unit": "GFLOP/s", "node_value": node_value,
            "link_gbs": link_gbs}  # fmt: skip


def test_a_slow_node_fails_and_a_slow_fabric_leaves_nobody_out():
    gate = LOCAL_HEALTH.gate
    judged, note = verdict([figures(1.0, node="a"), figures(0.0002, node="b")], gate.node_min, gate.link_min_gbs)
    assert [(f["node"], f["ok"], f["failed"]) for f in judged] == [("a", True, ""), ("b", False, "link")]
    assert judged[1]["reason"] == "link 0.0002 GB/s < 0.001" and note == ""
    judged, note = verdict([figures(1.0, node_value=0.1), figures(1.0)], gate.node_min, gate.link_min_gbs)
    assert [f["failed"] for f in judged] == ["node", ""]
    # every node under the link threshold: the fabric or the threshold, not a node
    judged, note = verdict([figures(0.0001), figures(0.0002)], gate.node_min, gate.link_min_gbs)
    assert all(f["ok"] for f in judged) and "none left out" in note


@pytest.fixture(scope="module")
def machine() -> Iterator[tuple[Path, Path, Path]]:
    """Three nodes in a directory every user may traverse; carol added by the admin. Yields the state
    directory, carol's description and her code."""
    root = Path(tempfile.mkdtemp(prefix="dtrain-gate-", dir="/tmp"))
    root.chmod(0o755)
    state, name = root / "cluster", cluster_name("q")
    local_cluster.up(nodes=3, state_dir=state, name=name, subnet=free_subnet())
    try:
        admin = str(state / "cluster.json")
        keygen(root / "carol", "carol")
        added = run_module("dtrain", "users", "add", "carol", "--ssh-key", f"{root / 'carol'}.pub",
                           "--account", "vision", "--cluster", admin)  # fmt: skip
        assert added.returncode == 0, added.stderr
        described = run_module("dtrain", "cluster", "for-user", "carol", "--ssh-key", str(root / "carol"),
                               "-o", str(root / "carol.json"), "--cluster", admin)  # fmt: skip
        assert described.returncode == 0, described.stderr
        code = root / "code"
        code.mkdir()
        (code / "job.py").write_text(JOB)
        (code / "requeue.py").write_text(REQUEUE_ITSELF)
        yield state, root / "carol.json", code
    finally:
        local_cluster.down(state, quiet=True)
        assert leftovers(state, name) == []
        shutil.rmtree(root, ignore_errors=True)


def test_a_slow_node_is_drained_with_its_figure_and_the_job_finishes_on_the_others(machine):
    state, _, code = machine
    desc_file = state / "cluster.json"
    local_cluster.set_link_rate(state, SLOW, node="node-1")
    launched = run_module("dtrain", "launch", "--cluster", str(desc_file), "--workdir", str(code), "--nodes", "2",
                          "--mode", "per-node", "--run-id", "gated", "--detach", "--", "python3", "job.py")  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    run = state / "shared" / "runs" / "gated"
    log_file = run / "output.log"
    wait_for(lambda: log_file.exists() and "gate: requeueing" in log_file.read_text(), 300, "the gate to requeue it")
    # the drained node's Epilog lifts the two minutes Slurm holds a requeued job back
    wait_for(lambda: "attempt 2," in log_file.read_text(), REQUEUE_HOLD_S - 20, "attempt 2 to start", interval=1)
    status = wait_for(
        lambda: (s := _json(run / "status.json")) and s.get("attempt") == 2 and s.get("results") != "uploading" and s,
        JOB_DONE_S,
        "the job's second attempt to end",
        interval=1,
    )
    log = (run / "output.log").read_text()
    assert status["exit_code"] == 0, log[-3000:]
    assert "[gate] node-1: matmul" in log and "left out: link" in log, log
    assert "[job] gate: requeueing the job without node-1" in log
    assert "attempt 2, on node-0,node-2" in log and "[job] gate: every node passed" in log
    assert log.count("trained") == 2  # once per node, in the second attempt only
    desc = load(desc_file)
    reason = slurm_command(desc, "sinfo", "-h", "-R", "-n", "node-1", "-o", "%E").stdout.strip()
    assert reason.startswith("gate: link ") and "GB/s < 0.001 (job " in reason, reason
    record = json.loads((run / "run.json").read_text())
    first, second = record["attempts"]
    assert [e["node"] for e in first["gate"]["excluded"]] == ["node-1"] and second["gate"]["excluded"] == []
    metrics = (state / TELEMETRY / "node-1" / "dtrain_gate.prom").read_text()
    assert 'dtrain_gate_passed{node="node-1"} 0' in metrics and "dtrain_gate_link_gbps" in metrics
    # a passed gate's figures too, once the job has ended and node-2's Epilog has run
    passed = state / TELEMETRY / "node-2" / "dtrain_gate.prom"
    wait_for(passed.exists, 120, "node-2's Epilog to record its figures")
    assert 'dtrain_gate_passed{node="node-2"} 1' in passed.read_text()


def test_a_persons_job_may_requeue_itself_as_the_gate_does(machine):
    state, carol, code = machine
    launched = run_module("dtrain", "launch", "--cluster", str(carol), "--workdir", str(code), "--mode", "per-node",
                          "--run-id", "requeues-itself", "--detach", "--", "python3", "requeue.py")  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    desc = load(carol)
    job = (state / "shared" / "runs" / "requeues-itself" / "job_id").read_text().strip()

    def restarted() -> bool:
        shown = slurm_command(desc, "scontrol", "show", "job", job).stdout
        return "Restarts=1" in shown and "JobState=PENDING" in shown

    wait_for(restarted, 120, "the person's job to requeue itself", interval=1)
    slurm_command(desc, "scancel", job)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
