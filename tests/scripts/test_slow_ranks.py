"""Slow ranks on the local cluster (real Slurm, sshd, Horovod across node namespaces): a rank whose node's
CPU share is cut mid-run through a cgroup is named in the job's log, in `jobs` and in `status` within a
minute; `drain NODE --requeue` drains the node, and the job is requeued and resumes from its checkpoint
on the other nodes; `drain NODE --undo` gives the node back. And without a cluster: the login node's
reading of slow_ranks.json (a last attempt's is left out) and how `jobs` and `status` show it."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from dtrain.cli.jobs import job_rows, jobs_table, nodes_table
from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.slurm import NodeInfo, QueuedJob
from dtrain.errors import ExitCode
from dtrain.jobs.runs import Run
from dtrain.jobs.slow_ranks import by_node, running_slow_ranks
from dtrain.local.state import load_state
from dtrain.remote.login import list_runs
from dtrain.ui import make_console
from tests.cpu_limit import cgroup_cpu_problem, cpu_limited
from tests.polling import wait_for

from .conftest import local_state_dir, own_cluster, slurm_command
from .test_launcher import cli, job_id_of, run_dir, squeue_state, start_long_job

# synthetic data, steps short enough to log every few seconds even under the CPU limit; checkpoints to resume from
JOB = ("--data", "synthetic", "--model", "resnet_tiny", "--image-size", "32", "--batch-size", "8")
JOB += ("--steps", "100000", "--log-every", "2", "--checkpoint-every", "20", "--warmup-epochs", "0")
JOB += ("--timing-warmup-steps", "5")
NAMED_WITHIN_S = 60  # the bound: from the cut to the name in the job's log
CUT_PERCENT = 25  # of one CPU, for all the job's processes on the node


def job_pids_on(namespace: str | None, run_id: str, also: str = "") -> list[int]:
    """The job's processes in one node's namespace (their environment carries the run's id, and also)."""
    assert namespace is not None
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    found = []
    for pid in listed:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RUN_ID={run_id}".encode() in environ and (not also or also.encode() in environ):
            found.append(int(pid))
    return found


def node_of_rank(desc: ClusterDescription, run_id: str, rank: int) -> tuple[str, str | None]:
    """(node, its namespace) where the run's rank runs."""
    nodes = load_state(local_state_dir(desc)).nodes
    return next((n.hostname, n.namespace) for n in nodes if job_pids_on(n.namespace, run_id, f"HOROVOD_RANK={rank}"))


def squeue(desc: ClusterDescription, job_id: str, fields: str) -> str:
    return slurm_command(desc, "squeue", "--noheader", f"--jobs={job_id}", f"--format={fields}").stdout.strip()


def node_state(desc: ClusterDescription, node: str) -> str:
    """sinfo's state of the node (listed once per partition: on demand and Spot)."""
    listed = slurm_command(desc, "sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%T").stdout
    return listed.split()[0]


@pytest.mark.skipif(cgroup_cpu_problem() is not None, reason=str(cgroup_cpu_problem()))
def test_a_rank_slowed_mid_run_is_named_within_a_minute_and_drain_requeue_moves_its_job(tmp_path):
    with own_cluster(tmp_path, "w", nodes=3) as desc:
        cluster_file = str(local_state_dir(desc) / "cluster.json")
        launch = ["launch", "--cluster", cluster_file, "--framework", "pytorch", "--nodes", "2"]
        # --no-gate: the slow node is made mid-run; the gate's own verdict on a loaded machine is not the subject
        proc = cli(*launch, "--run-id", "slow-run", "--requeue", "--no-gate", "--detach", "--", *JOB)
        assert proc.returncode == 0, proc.stderr
        job_id = job_id_of(proc)
        log = run_dir(desc, "slow-run") / "output.log"
        stepping = re.compile(r"^\[0\|node-\d\]!? .*step 20/", re.M)
        wait_for(lambda: log.exists() and stepping.search(log.read_text()), 240, "the first log steps", interval=0.5)
        node, namespace = node_of_rank(desc, "slow-run", 1)
        named = re.compile(rf"\[slow rank\] rank 1 on {node}: compute [\d.]+ s/step, [\d.]+x the median .*")
        assert "[slow rank]" not in log.read_text()  # nothing is wrong yet: nothing named

        with cpu_limited(job_pids_on(namespace, "slow-run"), CUT_PERCENT):  # the whole node's share of the job
            cut = time.monotonic()
            wait_for(lambda: named.search(log.read_text()), 180, "rank 1 named in the job's log", interval=0.5)
            took = time.monotonic() - cut
            assert took < NAMED_WITHIN_S, f"named {took:.0f} s after the cut:\n" + log.read_text()[-6000:]
            assert "[slow rank] rank 0" not in log.read_text()

            listing = cli("jobs", "--cluster", cluster_file)
            assert re.search(rf"{job_id}\s.*slow-run.*RUNNING.*slow: rank 1 on {node}", listing.stdout), listing.stdout
            rows = json.loads(cli("jobs", "--cluster", cluster_file, "--json").stdout)["jobs"]
            [slow] = next(row for row in rows if row["job"] == job_id)["slow_ranks"]
            assert (slow["rank"], slow["host"], slow["run"]) == (1, node, "slow-run") and slow["ratio"] > 1.5
            status = cli("status", "--cluster", cluster_file)
            assert re.search(rf"{node}\s.*job {job_id} rank 1: [\d.]+x", status.stdout), status.stdout

            drained = cli("drain", node, "--requeue", "--cluster", cluster_file)
            assert drained.returncode == 0, drained.stderr
            assert f"{node} drained (drained by root: slow rank)" in drained.stderr
            assert f"job {job_id} requeued off {node}" in drained.stderr

        assert node_state(desc, node) in ("drained", "draining")
        # the same job, again: a second attempt on the two other nodes, from the run's newest checkpoint
        started = run_dir(desc, "slow-run") / "attempts.started"
        wait_for(lambda: len(started.read_text().splitlines()) == 2, 120, "the second attempt", interval=0.5)
        wait_for(lambda: squeue(desc, job_id, "%T") == "RUNNING", 60, "the job to run again", interval=0.5)
        assert node not in squeue(desc, job_id, "%N")
        wait_for(lambda: "resuming from" in log.read_text(), 180, "the resume from the checkpoint", interval=0.5)
        assert cli("jobs", "--cluster", cluster_file).stdout.count("slow: rank") == 0  # the new attempt's verdict

        undone = cli("drain", node, "--undo", "--cluster", cluster_file)
        assert undone.returncode == 0 and f"{node} resumed" in undone.stderr, undone.stderr
        wait_for(lambda: node_state(desc, node) == "idle", 60, f"{node} idle again", interval=0.5)
        assert cli("cancel", "--cluster", cluster_file, job_id).returncode == 0


def test_drain_refuses_an_unknown_node_and_names_a_job_it_cannot_requeue(cluster, cluster_file):
    """On the session's cluster, given back as it was: a job launched without --requeue has nothing to resume
    from; Slurm refuses to requeue it and `drain` says so (exit 1), the node drained all the same."""
    job_id = start_long_job(cluster, cluster_file, "not-requeued")
    try:
        proc = cli("drain", "node-1", "--requeue", "--cluster", str(cluster_file))
        assert proc.returncode == ExitCode.FAILED, proc.stderr
        [error] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert error.startswith(f"error: node-1 is drained, but Slurm did not requeue {job_id} (job {job_id}: ")
        assert "launched without --requeue" in error and squeue_state(cluster, job_id) == "RUNNING"
        assert node_state(cluster, "node-1") in ("draining", "drained")
    finally:
        assert cli("drain", "node-1", "--undo", "--cluster", str(cluster_file)).returncode == 0
        assert cli("cancel", "--cluster", str(cluster_file), job_id).returncode == 0
    proc = cli("drain", "node-9", "--cluster", str(cluster_file))
    assert proc.returncode == ExitCode.BAD_INPUT and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: no node node-9 in cluster {json.loads(cluster_file.read_text())['name']} (its nodes: node-0, node-1)"
    ]
    again = cli("drain", "node-0", "--undo", "--cluster", str(cluster_file))  # not drained: nothing to undo
    assert again.returncode == 0 and "node-0 is not drained" in again.stderr


# --- without a cluster ------------------------------------------------------------------------------
SLOW = {"slow": [{"rank": 1, "host": "node-1", "compute_s": 0.52, "median_s": 0.31, "ratio": 1.677,
                  "since": "2026-12-07T10:00:00Z", "since_step": 40}]}  # fmt: skip


def test_the_login_node_reads_slow_ranks_of_the_attempt_running_only(tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "job.json").write_text("{}")
    (run / "slow_ranks.json").write_text(json.dumps(SLOW))
    written = int((run / "slow_ranks.json").stat().st_mtime)
    (run / "attempts.started").write_text(f"1 {written - 60} gpu\n")
    [entry] = list_runs.list_runs(str(tmp_path / "runs"), limit=0, also=["r1", "gone"])  # limit 0: just these
    assert entry["slow_ranks"] == SLOW
    (run / "attempts.started").write_text(f"1 {written - 60} gpu\n2 {written + 60} gpu\n")  # requeued since
    assert list_runs.list_runs(str(tmp_path / "runs"), run="r1")[0]["slow_ranks"] is None


def test_jobs_and_status_show_a_running_jobs_slow_ranks_beside_the_job_and_its_node():
    queue = [QueuedJob("42", "r1", "RUNNING", "root", "2", "5:00", "node-[0-1]")]
    runs = [Run("r1", "42", "/shared/runs/r1", job={}, slow_ranks=SLOW), Run("r0", "41", "/x", slow_ranks=SLOW)]
    slow = running_slow_ranks(queue, runs)  # the ended run's file is history: not shown
    assert list(slow) == ["42"] and slow["42"][0].run == "r1" and slow["42"][0].host == "node-1"
    rows = [row.model_copy(update={"slow_ranks": slow.get(row.job or "", [])}) for row in job_rows(queue, [], {})]
    console = make_console(stderr=False)
    console.width = 250  # print(width=) cannot widen past the console's own (150 off a terminal)
    with console.capture() as captured:
        console.print(jobs_table(rows))
    assert re.search(r"42 .*RUNNING.*slow: rank 1 on node-1 \(1\.7x the median compute\); node-\[0-1\]", captured.get())
    nodes = [NodeInfo("node-0", "mixed", "none", "2", "(null)"), NodeInfo("node-1", "mixed", "none", "2", "(null)")]
    with console.capture() as captured:
        console.print(nodes_table(nodes, {}, {}, {}, by_node(slow)))
    shown = captured.get()
    assert "slow ranks" in shown and re.search(r"node-1 .*job 42 rank 1: 1\.7x", shown)
    assert not re.search(r"node-0 .*job 42", shown)
