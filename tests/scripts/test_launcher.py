"""`launch`, `jobs`, `logs`, `cancel` and `status` against the local cluster's real Slurm (slurmctld in a head
namespace, slurmd in each node namespace), through the jump host's sshd, with Horovod over gloo and the
results uploaded by the job itself to Azurite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from azure.storage.blob import ContainerSasPermissions, generate_container_sas
from PIL import Image

from dtrain.cluster.blobs import container_client
from dtrain.cluster.description import ClusterDescription
from dtrain.datasets import staging
from dtrain.jobs.follow import CANCEL_WAIT_S
from dtrain.local import power as local_power
from dtrain.local.cluster import AZURITE_KEY
from dtrain.local.state import AZURITE_ACCOUNT
from tests.polling import wait_for

from .conftest import (
    JOB,
    REPO,
    SESSION_NAME,
    live_pids_mentioning,
    local_state_dir,
    own_cluster,
    run_module,
    start_module,
)

CLI = "dtrain"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"


def launch_args(cluster_file: Path, *job_args: str, run_id: str, nodes: int = 2, extra: tuple[str, ...] = ()) -> list:
    return [
        "launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", str(nodes),
        "--entrypoint", JOB, "--run-id", run_id, *extra, "--", *job_args,
    ]  # fmt: skip


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_module(CLI, *args, timeout=timeout)


def run_dir(cluster: ClusterDescription, run_id: str) -> Path:
    return Path(cluster.shared_mount_path) / "runs" / run_id


def job_id_of(proc: subprocess.CompletedProcess) -> str:
    match = re.search(r"submitted job (\d+)", proc.stdout + proc.stderr)
    assert match, proc.stdout + proc.stderr
    return match.group(1)


def status_of(cluster: ClusterDescription, run_id: str) -> dict | None:
    """The run's status.json once the job has ended and its results upload has too."""
    path = run_dir(cluster, run_id) / "status.json"
    status = json.loads(path.read_text()) if path.exists() else None
    return status if status and status["results"] != "uploading" else None


def squeue_state(cluster: ClusterDescription, job_id: str) -> str:
    assert cluster.slurm and cluster.slurm.conf
    proc = subprocess.run(
        ["squeue", "--noheader", f"--jobs={job_id}", "--format=%T"],
        env={**os.environ, "SLURM_CONF": cluster.slurm.conf},
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip()


def node_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{SESSION_NAME}-node-")]


def job_processes_on_nodes(marker: str) -> dict[str, list[int]]:
    """namespace -> pids of processes in that node namespace whose command line mentions marker, or whose
    environment is the run's (RUN_ID=marker: a rank's command line is only what the job was given)."""
    found = {}
    for namespace in node_namespaces():
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        hits = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in cmdline or f"RUN_ID={marker}".encode() in environ:
                hits.append(int(pid))
        found[namespace] = hits
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def results_blobs(cluster: ClusterDescription, run_id: str) -> dict[str, bytes]:
    client = container_client(cluster.results)
    return {b.name: client.download_blob(b.name).readall() for b in client.list_blobs(name_starts_with=f"{run_id}/")}


def world_writable(root: Path) -> list[str]:
    return [str(p) for p in [root, *root.rglob("*")] if not p.is_symlink() and p.lstat().st_mode & 0o002]


def others_can_read(path: Path, root: Path) -> bool:
    """Another user can read path: it is open to others, and so is every directory from root down to it."""
    folders = [d for d in path.parents if d.is_relative_to(root)]
    return all(p.stat().st_mode & bit for p, bit in [(path, 0o004), *((d, 0o001) for d in folders)])


def readable_by_others_holding(root: Path, text: bytes) -> list[str]:
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and others_can_read(p, root)]
    return [str(p) for p in files if text in p.read_bytes()]


# --- a whole job -------------------------------------------------------------------------------
def test_two_node_job_prefixed_logs_exit_code_and_results(cluster, cluster_file, tmp_path):
    proc = cli(*launch_args(cluster_file, "--steps", "3", run_id="ok-run", extra=("--follow",)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^\[0\|node-0\] hello from rank 0/2 on node-0", out, re.M), out[-3000:]
    assert re.search(r"^\[1\|node-1\] hello from rank 1/2 on node-1", out, re.M), out[-3000:]
    assert "job ok-run" not in out and f"job {job_id_of(proc)} (run ok-run): ok" in out
    # the run directory: the submitter's own, nothing in it (or anywhere on the share) open to everyone
    directory = run_dir(cluster, "ok-run")
    assert directory.stat().st_mode & 0o777 == 0o700
    assert world_writable(Path(cluster.shared_mount_path)) == []
    # the SAS the job uploaded with (and staging's) is in no file another user can read: Azurite's log included
    assert readable_by_others_holding(local_state_dir(cluster), b"sig=") == []
    assert (local_state_dir(cluster) / "logs").stat().st_mode & 0o777 == 0o700
    # the job itself uploaded its run: logs, metrics, the request, its exit; never the SAS or checkpoints
    blobs = results_blobs(cluster, "ok-run")
    assert {"ok-run/output.log", "ok-run/metrics.json", "ok-run/job.json", "ok-run/status.json"} <= set(blobs)
    assert not [name for name in blobs if name.endswith(".sas") or "/remote/" in name]
    assert json.loads(blobs["ok-run/metrics.json"])["hosts"] == ["node-0", "node-1"]
    assert json.loads(blobs["ok-run/status.json"])["exit_code"] == 0
    assert b"[1|node-1] rank 1 done" in blobs["ok-run/output.log"]
    # what it cost: two nodes for the job's wall time, at the local cluster's price, in run.json and the summary
    record = json.loads(blobs["ok-run/run.json"])
    assert [a["attempt"] for a in record["attempts"]] == [1] and record["attempts"][0]["nodes"] == 2
    assert 0 < record["node_hours"] < 1 and record["estimated_cost_usd"] == 0.0
    assert record["price_source"] == "local cluster: no charge"
    assert re.search(r"\(run ok-run\): [\d.]+ node-hours, estimated \$0\.00", out)
    # `results` brings the run back; a second time it finds every file already there
    got = cli("results", "--cluster", str(cluster_file), "ok-run", "--dest", str(tmp_path), "--no-progress")
    assert got.returncode == 0, got.stderr
    assert json.loads((tmp_path / "ok-run" / "run.json").read_text()) == record
    assert (tmp_path / "ok-run" / "output.log").read_bytes() == blobs["ok-run/output.log"]
    again = cli("results", "--cluster", str(cluster_file), "ok-run", "--dest", str(tmp_path), "--no-progress")
    assert f"(0 downloaded, 0 bytes; {len(blobs)} already there)" in again.stderr
    missing = cli("results", "--cluster", str(cluster_file), "no-such-run", "--dest", str(tmp_path))
    assert missing.returncode == 2 and "no results for run no-such-run" in missing.stderr


def test_a_failing_rank_sets_the_exit_status_and_is_named(cluster, cluster_file):
    job_args = ("--steps", "2", "--exit-code", "3", "--fail-rank", "1")
    proc = cli(*launch_args(cluster_file, *job_args, run_id="fail-run", extra=("--follow",)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "rank 1 on node-1 failed" in out
    assert status_of(cluster, "fail-run")["exit_code"] == 3
    # horovodrun's traceback stays in the run's log, off the console
    assert "Traceback" not in out and "[horovodrun] Process 1 exit with status code 3." in out
    assert "Traceback (most recent call last):" in (run_dir(cluster, "fail-run") / "output.log").read_text()
    # `logs -f` shows what `launch --follow` shows
    again = cli("logs", "--cluster", str(cluster_file), "fail-run", "-f")
    assert again.returncode == 3 and "rank 1 on node-1 failed" in again.stderr
    assert "Traceback" not in again.stdout + again.stderr, again.stdout[-3000:]


# --- the queue -------------------------------------------------------------------------------------
def test_second_job_waits_for_the_nodes_then_runs(cluster, cluster_file):
    # the first job runs long enough (40 s of steps) to be running still when `jobs` lists it on a loaded
    # machine, where the listing itself takes seconds
    first = cli(*launch_args(cluster_file, "--steps", "40", "--sleep", "1", run_id="queue-a", extra=("--detach",)))
    second = cli(*launch_args(cluster_file, "--steps", "8", "--sleep", "1", run_id="queue-b", extra=("--detach",)))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    job_a, job_b = job_id_of(first), job_id_of(second)
    assert first.stdout.strip() == job_a  # --detach: the job id alone on stdout
    wait_for(lambda: squeue_state(cluster, job_a) == "RUNNING", 60, "the first job to run", interval=0.5)
    assert squeue_state(cluster, job_b) == "PENDING"
    listing = cli("jobs", "--cluster", str(cluster_file))
    assert listing.returncode == 0
    assert re.search(rf"{job_a}\s.*queue-a.*RUNNING", listing.stdout), listing.stdout
    assert re.search(rf"{job_b}\s.*queue-b.*PENDING", listing.stdout), listing.stdout
    for run_id in ("queue-a", "queue-b"):
        status = wait_for(lambda r=run_id: status_of(cluster, r), 180, f"{run_id} to end", interval=1)
        assert status["exit_code"] == 0
    started = [json.loads((run_dir(cluster, r) / "status.json").read_text()) for r in ("queue-a", "queue-b")]
    assert started[0]["finished_at"] <= started[1]["finished_at"]
    listing = cli("jobs", "--cluster", str(cluster_file))
    for job_id, run_id in ((job_a, "queue-a"), (job_b, "queue-b")):  # ended: with node-hours and cost
        assert re.search(rf"{job_id}\s.*{run_id}.*COMPLETED.*│ 0 +│ [\d.]+ +│ \$0\.00", listing.stdout), listing.stdout


# --- cancel ----------------------------------------------------------------------------------------
def start_long_job(cluster, cluster_file, run_id: str) -> str:
    proc = cli(*launch_args(cluster_file, "--steps", "600", "--sleep", "0.5", run_id=run_id, extra=("--detach",)))
    assert proc.returncode == 0, proc.stderr
    log = run_dir(cluster, run_id) / "output.log"
    wait_for(lambda: log.exists() and "[1|node-1] step 1" in log.read_text(), 90, "both ranks to step", interval=0.5)
    return job_id_of(proc)


def test_cancel_stops_every_process_on_every_node(cluster, cluster_file):
    job_id = start_long_job(cluster, cluster_file, "cancel-run")
    assert all(job_processes_on_nodes("cancel-run").values())  # the job runs on both nodes
    started = time.monotonic()
    proc = cli("cancel", "--cluster", str(cluster_file), job_id)
    took = time.monotonic() - started
    # cancel's own wait (CANCEL_WAIT_S), then its SSH round trips on a loaded machine (46 s at load 16)
    assert proc.returncode == 0 and took < CANCEL_WAIT_S + 60, (took, proc.stderr)
    assert job_processes_on_nodes("cancel-run") == {ns: [] for ns in node_namespaces()}
    assert squeue_state(cluster, job_id) == ""
    # the job's EXIT trap still recorded the cancel and uploaded the run
    assert status_of(cluster, "cancel-run")["exit_code"] == 143
    assert "cancel-run/output.log" in results_blobs(cluster, "cancel-run")
    again = cli("cancel", "--cluster", str(cluster_file), "cancel-run")  # by run id, once it has ended
    assert again.returncode == 0 and "already ended" in again.stderr


# --- the operator goes away ------------------------------------------------------------------------
def follow_until_both_ranks_run(launch: list, interruptible: bool = False) -> subprocess.Popen:
    """`launch --follow` in the background, once its output shows the second rank running."""
    follower = start_module(CLI, *launch, interruptible=interruptible)
    assert follower.stdout is not None
    for line in follower.stdout:
        if "hello from rank 1" in line:
            break
    return follower


def test_job_outlives_a_killed_follower(cluster, cluster_file):
    args = launch_args(cluster_file, "--steps", "10", "--sleep", "0.5", run_id="orphan-run", extra=("--follow",))
    follower = follow_until_both_ranks_run(args)
    follower.send_signal(signal.SIGKILL)
    follower.wait(timeout=10)
    status = wait_for(lambda: status_of(cluster, "orphan-run"), 120, "the job to end on its own", interval=1)
    assert status["exit_code"] == 0
    assert "orphan-run/metrics.json" in results_blobs(cluster, "orphan-run")
    logs = cli("logs", "--cluster", str(cluster_file), "orphan-run")
    assert logs.returncode == 0 and "[0|node-0] step 9 sum 3" in logs.stdout
    followed = cli("logs", "--cluster", str(cluster_file), status["job_id"], "-f")  # an ended job: its exit
    assert followed.returncode == 0 and "[1|node-1] rank 1 done" in followed.stdout


def test_ctrl_c_without_a_terminal_detaches(cluster, cluster_file):
    args = launch_args(cluster_file, "--steps", "600", "--sleep", "0.5", run_id="detach-run", extra=("--follow",))
    follower = follow_until_both_ranks_run(args, interruptible=True)
    follower.send_signal(signal.SIGINT)
    rest = follower.communicate(timeout=30)[0]
    assert follower.returncode == 130 and "detached" in rest
    job_id = (run_dir(cluster, "detach-run") / "job_id").read_text().strip()
    assert squeue_state(cluster, job_id) == "RUNNING"
    assert cli("cancel", "--cluster", str(cluster_file), "detach-run").returncode == 0


# --- what is refused before anything is submitted ---------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--run-id", "../escape"), "invalid run id"),
        (("--run-id", "a/b"), "invalid run id"),
        (("--nodes", "3"), "the cluster has 2 nodes"),
        (("--launcher", "torchrun", "--framework", "keras"), "torchrun runs PyTorch jobs only"),
        (("--model-parallel", "--framework", "keras"), "--model-parallel is PyTorch's"),
        (("--model-parallel", "--launcher", "horovodrun"), "runs under torchrun: leave out --launcher horovodrun"),
        (
            ("--launcher", "horovodrun", "--", "--backend", "ddp"),
            "--backend ddp does not run under --launcher horovodrun",
        ),
        (
            ("--launcher", "torchrun", "--", "--backend", "horovod"),
            "--backend horovod does not run under --launcher torchrun",
        ),
        (("--model-parallel", "--entrypoint", "job.py"), "leave out --entrypoint"),
        (("--local-copy",), "--local-copy copies the job's --data-dir"),
        (("--local-copy", "--", "--data-dir", "/etc"), "--local-copy: --data-dir /etc is not a dataset under"),
        (("--", "--data-dir", "/etc"), "--data-dir /etc is not a dataset under the cluster's data path"),
        (("--entrypoint", "/nonexistent/x.py"), "--entrypoint /nonexistent/x.py: /nonexistent/x.py does not exist"),
        # the nodes have 2 CPUs and no GPUs: Slurm itself would refuse 3 tasks a node, with exit 1
        (("--gpus-per-node", "3"), "--gpus-per-node 3 runs 3 processes on each node, and the nodes of cluster"),
        (("--gpus-per-node", "16"), "--gpus-per-node 16 runs 16 processes on each node"),
    ],
)
def test_bad_requests_are_refused_clearly(cluster_file, extra, message):
    base = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--detach"]
    proc = cli(*base, *extra, "--", "--steps", "1")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(error_lines(proc.stderr)) == 1, proc.stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def test_missing_or_one_class_dataset_and_reused_run_id_are_refused(cluster, cluster_file):
    missing = f"{cluster.data_path}/no-such-dataset"
    proc = cli(*launch_args(cluster_file, "--data-dir", missing, run_id="no-data", extra=("--detach",)))
    # the allocation and its cost come first (stderr: stdout is job.sh's under --dry-run), then one error line
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        f"error: --data-dir {missing} is not on the shared file system: stage the dataset first "
        "(dtrain stage all DIR --dataset NAME)"
    ]
    assert not run_dir(cluster, "no-data").exists()
    one_class = Path(cluster.data_path) / "one-class"
    (one_class / "train" / "n01440764").mkdir(parents=True)
    args = ("--data", "imagenet", "--data-dir", str(one_class))
    proc = cli("launch", "--cluster", str(cluster_file), "--framework", "keras", "--run-id", "one-class", "--", *args)
    assert proc.returncode == 2 and len(error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--data-dir {one_class} has one class folder under train/: a classifier needs at least two" in proc.stderr
    assert not run_dir(cluster, "one-class").exists()
    (run_dir(cluster, "taken")).mkdir(parents=True, mode=0o700)
    proc = cli(*launch_args(cluster_file, run_id="taken", extra=("--detach",)))
    assert proc.returncode == 2 and "already used" in proc.stderr


@pytest.mark.parametrize("command", ["logs", "cancel"])
def test_unknown_jobs_are_named(cluster_file, command):
    for job in ("999999", "no-such-run"):
        proc = cli(command, "--cluster", str(cluster_file), job)
        assert proc.returncode == 2 and job in proc.stderr and "Traceback" not in proc.stderr


def test_status_lists_nodes_and_queue(cluster_file):
    proc = cli("status", "--cluster", str(cluster_file))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"node-0\s.*idle", proc.stdout) and re.search(r"node-1\s.*idle", proc.stdout)
    assert "2 nodes: 2 idle; 0 powered down; queue: 0 running, 0 pending" in proc.stdout


# --- a node fails --------------------------------------------------------------------------------
def test_requeued_job_resumes_from_its_checkpoint_after_a_node_fails(tmp_path):
    """--requeue: node-1 is switched off mid-job; Slurm loses it and the job is requeued; the head node's
    reconcile powers the node down through Slurm, which starts it again for the job, and the job resumes
    from the run's newest checkpoint, ending at the right step."""
    steps = 400
    with own_cluster(tmp_path, "r") as desc:
        state_dir = local_state_dir(desc)
        cluster_file = state_dir / "cluster.json"
        job_args = (
            "--data", "synthetic", "--model", "simple_cnn", "--image-size", "32", "--batch-size", "8",
            "--steps", str(steps), "--checkpoint-every", "20", "--log-every", "20", "--warmup-epochs", "0",
        )  # fmt: skip
        base = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2", "--run-id"]
        base.append("requeue-run")
        proc = cli(*base, "--requeue", "--detach", "--", *job_args)
        assert proc.returncode == 0, proc.stderr
        log = run_dir(desc, "requeue-run") / "output.log"
        wait_for(lambda: log.exists() and "step 100/" in log.read_text(), 240, "step 100", interval=0.5)
        local_power.stop_node(state_dir, "node-1")
        job_id = proc.stdout.strip()
        wait_for(lambda: squeue_state(desc, job_id) == "PENDING", 120, "Slurm to requeue the job", interval=1)
        status = wait_for(
            lambda: (s := status_of(desc, "requeue-run")) and s["attempt"] == 2 and s,
            300,
            "attempt 2 to end",
            interval=1,
        )
        assert status["exit_code"] == 0, log.read_text()[-3000:]
        metrics = json.loads((run_dir(desc, "requeue-run") / "metrics.json").read_text())
        assert metrics["steps"] == steps and metrics["resumed_from_step"] >= 100, metrics
        assert "node node-1 does not answer: requeueing the job" in log.read_text()


def test_a_submission_resumes_power_saved_nodes(tmp_path):
    """Autostop: idle nodes are suspended after a few seconds (slurmd and sshd stopped); a job submitted
    with `launch` makes Slurm resume them, and it runs on both."""
    with own_cluster(tmp_path, "p", autostop_seconds=3) as desc:
        cluster_file = local_state_dir(desc) / "cluster.json"

        def node_states() -> str:
            shown = cli("status", "--cluster", str(cluster_file))
            return shown.stdout

        wait_for(lambda: "2 powered down" in node_states(), 60, "both nodes powered down", interval=1)

        def slurmds() -> list[int]:
            """The nodes' slurmd (not the head's slurmdbd, whose command line also says slurmd)."""
            ours = (pid for pid in live_pids_mentioning("slurmd") if str(local_state_dir(desc)) in cmdline(pid))
            return [pid for pid in ours if Path((cmdline(pid).split() or [""])[0]).name == "slurmd"]

        # Slurm counts a node powered down once SuspendTimeout has passed since it ran the suspend
        # program, which may still be killing the node on a loaded host: its slurmd goes soon after
        wait_for(lambda: not slurmds(), 60, "the suspended nodes' slurmd gone", interval=0.5)
        args = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2", "--entrypoint", JOB]
        proc = cli(*args, "--run-id", "wake-up", "--follow", "--", "--steps", "2", timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert "[1|node-1] rank 1 done" in proc.stdout


def test_local_copy_fills_each_nodes_own_disk_and_the_job_reads_it(cluster, cluster_file):
    """--local-copy: every node copies the dataset from the share to its own disk (STATE/nvme/<node>, each
    node seeing its own at local_data_path), verified, and the real PyTorch job trains from that copy."""
    source = Path(cluster.data_path) / "local-copy-tiny"
    staging.generate_synthetic_imagenet(source, classes=2, train_per_class=4, val_per_class=1, image_size=32)
    job_args = ("--data", "imagenet", "--data-dir", str(source), "--model", "resnet_tiny", "--image-size", "32")
    job_args += ("--batch-size", "4", "--steps", "2", "--num-classes", "2", "--warmup-epochs", "0")
    launch = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2", "--local-copy"]
    proc = cli(*launch, "--run-id", "local-copy-run", "--follow", "--", *job_args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    local = f"{cluster.local_data_path}/local-copy-tiny"
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())
    state = local_state_dir(cluster)
    for node in ("node-0", "node-1"):
        copy = state / "nvme" / node / "local-copy-tiny"
        assert json.loads((copy / ".copy-complete.json").read_text())
        assert all((copy / name).read_bytes() == (source / name).read_bytes() for name in files)
    assert not any(Path(cluster.local_data_path).iterdir())  # the host's own view: the copies are the nodes'
    record = json.loads((run_dir(cluster, "local-copy-run") / "job.json").read_text())
    assert record["local_copy"] == {"source": str(source), "dest": local}
    command = record["command"]
    assert command[command.index("--data-dir") + 1] == local


# --- what a real training run leaves ---------------------------------------------------------------
def test_a_training_run_uploads_its_model_and_curves_and_predict_reads_the_model_through_a_read_sas(
    cluster, cluster_file, tmp_path
):
    """The real PyTorch job (not the fixture), with the outputs launch points into the run directory."""
    job_args = ("--model", "resnet_tiny", "--image-size", "32", "--batch-size", "4", "--num-classes", "3")
    job_args += ("--steps", "4", "--warmup-epochs", "0", "--timing-warmup-steps", "1", "--log-every", "1")
    launch = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2"]
    proc = cli(*launch, "--run-id", "model-run", "--follow", "--", *job_args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    names = set(results_blobs(cluster, "model-run"))
    assert {"model-run/model/model.json", "model-run/summary.png"} <= names, sorted(names)
    assert [n for n in names if n.startswith("model-run/tensorboard/events.out.tfevents.")]
    record = json.loads(container_client(cluster.results).download_blob("model-run/model/model.json").readall())
    assert record["run_id"] == "model-run" and record["framework"] == "pytorch"
    # predict, in the training environment, straight from the results container with a read + list SAS
    sas = generate_container_sas(
        AZURITE_ACCOUNT, cluster.results.container, account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True, list=True), expiry=datetime.now(UTC) + timedelta(hours=1),
    )  # fmt: skip
    (tmp_path / "read.sas").write_text(sas)
    image = tmp_path / "cat.jpg"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(image)
    url = f"{cluster.results.url}/model-run/model"
    predict = [str(TRAIN_PYTHON), "-m", "training.predict", "--model", url, str(image), "--json"]
    scored = subprocess.run(
        [*predict, "--sas-file", str(tmp_path / "read.sas")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert scored.returncode == 0, scored.stderr
    assert sas not in scored.stdout + scored.stderr  # the secret is never printed
    top = json.loads(scored.stdout)
    assert top, scored.stdout
    # without the SAS, the same URL is refused clearly
    refused = subprocess.run(predict, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode in (2, 3) and refused.stderr.startswith("error:"), refused.stderr


def test_a_model_parallel_run_shards_and_pipelines_across_two_nodes_of_two_processes(cluster, cluster_file):
    """training.model_parallel under torchrun on 2 nodes x 2 processes: 2 pipeline stages x FSDP over 2,
    with the same logs, metrics, gathered model and curves as the data-parallel jobs."""
    job_args = ("--model", "gpt-tiny", "--pp", "2", "--dp-shard", "-1", "--seq-len", "32", "--batch-size", "4")
    job_args += ("--steps", "4", "--log-every", "2", "--timing-warmup-steps", "1")
    launch = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "2", "--model-parallel"]
    proc = cli(*launch, "--gpus-per-node", "2", "--run-id", "mp-run", "--follow", "--", *job_args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^\[0\|node-0\].*gpt-tiny on pp 2 x dp_replicate 1 x dp_shard 2 x tp 1 \(world 4\)", out, re.M), (
        out
    )
    blobs = results_blobs(cluster, "mp-run")
    metrics = json.loads(blobs["mp-run/metrics.json"])
    assert metrics["job"] == "model_parallel" and metrics["world_size"] == 4
    assert metrics["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}
    assert len(metrics["peak_memory_bytes_per_rank"]) == 4 and metrics["tokens_per_sec"] > 0
    assert 0 < metrics["bubble_fraction"] < 1 and metrics["final_loss"] > 0
    assert json.loads(blobs["mp-run/run.json"])["attempts"][0]["nodes"] == 2
    card = json.loads(blobs["mp-run/model/model.json"])
    assert card["task"] == "causal-lm" and card["run_id"] == "mp-run" and "mp-run/model/model.pt2" in blobs
    assert "mp-run/summary.png" in blobs
    assert [name for name in blobs if name.startswith("mp-run/tensorboard/events.out.tfevents.")]
