"""`launch --workdir DIR -- COMMAND`: the user's own code, sent to the run directory and run there as
written on every rank, under torchrun or horovodrun, on the local cluster's real Slurm; its $OUTPUT_DIR
reaches the results container. Each of examples/ is run here as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dtrain.cluster.description import from_stack_outputs
from dtrain.jobs.batch_script import DOCKER_RUN_WITH_JOB_GPUS
from dtrain.jobs.submit import node_hour_price
from tests.polling import wait_for

from .conftest import REPO, private_key_file
from .test_cluster_description import OUTPUTS
from .test_launcher import cli, results_blobs, run_dir, status_of

# example -> launch flags, the script's own arguments (which must reach it unchanged)
EXAMPLES = {
    "ddp": (("--nodes", "2"), ["--epochs", "2", "--steps-per-epoch", "5"]),
    "horovod": (("--nodes", "2", "--launcher", "horovodrun"), ["--epochs", "1", "--steps-per-epoch", "5"]),
    "fsdp": (("--gpus-per-node", "2"), ["--steps", "3", "--layers", "1"]),
}


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_example_runs_as_written_and_its_outputs_reach_the_results_container(
    example, cluster, cluster_file, tmp_path
):
    # a copy outside the repository, with what its .gitignore keeps at home
    workdir = tmp_path / example
    shutil.copytree(REPO / "examples" / example, workdir)
    (workdir / "output").mkdir()
    (workdir / "output" / "stale.pt").write_bytes(b"x" * 1000)
    flags, script_args = EXAMPLES[example]
    run_id = f"own-{example}"
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(workdir), "--run-id", run_id, *flags]
    proc = cli(*launch, "--follow", "--", "python", "train.py", *script_args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "estimated cost: $0.00/hour" in out and "time limit 1:00:00" in out
    # the command ran as written, in the run's copy of the code, with nothing that .gitignore names
    directory = run_dir(cluster, run_id)
    assert sorted(p.name for p in (directory / "code").iterdir()) == [".gitignore", "train.py"]
    assert json.loads((directory / "job.json").read_text())["command"] == ["python", "train.py", *script_args]
    # what it wrote to $OUTPUT_DIR reached the results container; its code did not travel there
    blobs = results_blobs(cluster, run_id)
    metrics = json.loads(blobs[f"{run_id}/output/metrics.json"])
    assert metrics["argv"] == script_args and metrics["world_size"] == 2
    assert f"{run_id}/output/model.pt" in blobs and f"{run_id}/output.log" in blobs
    assert not [name for name in blobs if "/code/" in name]
    assert status_of(cluster, run_id)["exit_code"] == 0


def test_a_command_that_does_not_exist_is_named_as_the_reason(cluster, cluster_file, tmp_path):
    (tmp_path / "train.py").write_text("print('never run')\n")
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(tmp_path), "--run-id", "own-missing"]
    proc = cli(*launch, "--nodes", "2", "--follow", "--", "nosuchprog", "--flag")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # torchrun's traceback is the log's; the console and the verdict name the reason
    reason = "FileNotFoundError: [Errno 2] No such file or directory: 'nosuchprog'"
    assert f"(run own-missing): failed: {reason}" in out and "Traceback" not in out, out[-3000:]
    verdict = json.loads((run_dir(cluster, "own-missing") / "verdict.json").read_text())
    assert verdict["job_error"] == reason


def test_a_job_ended_by_its_time_limit_is_named_so(cluster, cluster_file, tmp_path):
    (tmp_path / "sleep.py").write_text("import sys, time\ntime.sleep(float(sys.argv[1]))\n")
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(tmp_path), "--run-id", "own-timeout"]
    proc = cli(*launch, "--time", "1", "--follow", "--", "python", "sleep.py", "150")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-3000:]
    assert "(run own-timeout): its time limit (1) ended it; ask for more with --time" in proc.stderr, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert status_of(cluster, "own-timeout")["ended_by"] == "time_limit"
    rows = json.loads(cli("jobs", "--cluster", str(cluster_file), "--json").stdout)["jobs"]
    row = next(row for row in rows if row["run"] == "own-timeout")
    assert (row["state"], row["note"]) == ("TIMEOUT", "its time limit (1) ended it")


# a rank that catches the warning: leaves a marker named after its node in $OUTPUT_DIR and ends
CATCHES_THE_WARNING = """
import os, signal, socket, sys, time
def warned(*_):
    open(os.path.join(os.environ["OUTPUT_DIR"], "warned-" + socket.gethostname()), "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, warned)
time.sleep(150)
"""


def test_the_time_limit_warning_reaches_the_ranks_that_catch_it_on_every_node(cluster, cluster_file, tmp_path):
    (tmp_path / "warned.py").write_text(CATCHES_THE_WARNING)
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(tmp_path), "--run-id", "own-warned"]
    # --time 1: the warning (30 s before the limit by default) comes within the first minute
    proc = cli(*launch, "--nodes", "2", "--time", "1", "--follow", "--", "python", "warned.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    output = run_dir(cluster, "own-warned") / "output"
    nodes = (run_dir(cluster, "own-warned") / "nodes").read_text().split()
    assert sorted(p.name for p in output.glob("warned-*")) == [f"warned-{node}" for node in sorted(nodes)]
    log = run_dir(cluster, "own-warned") / "output.log"
    wait_for(lambda: "time warning: SIGUSR1 sent to" in log.read_text(), 10, "the warning's summary line")
    assert "on 2 of 2 node(s)" in log.read_text(), log.read_text()[-3000:]


def test_own_code_in_tensorflows_image_runs_under_horovodrun_unless_told_otherwise(tmp_path):
    from dtrain.jobs.launch_request import LaunchRequest
    from dtrain.jobs.submit import choose_launcher

    own = {"workdir": str(tmp_path), "job_args": ("python", "train.py")}
    assert choose_launcher(LaunchRequest(framework="pytorch", **own)) == "torchrun"
    assert choose_launcher(LaunchRequest(framework="tensorflow", **own)) == "horovodrun"  # no torch in that image
    assert choose_launcher(LaunchRequest(framework="tensorflow", launcher="torchrun", **own)) == "torchrun"


def test_dry_run_prints_the_batch_script_and_submits_nothing(cluster, cluster_file):
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(REPO / "examples" / "ddp")]
    proc = cli(*launch, "--run-id", "dry", "--time", "2-00:00", "--dry-run", "--", "python", "train.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash\n") and "#SBATCH --time=2-00:00\n" in proc.stdout
    assert "#SBATCH --nodes=1\n" in proc.stdout and "#SBATCH --exclusive\n" in proc.stdout  # CPU nodes: whole
    assert "torchrun --nnodes 1 --nproc-per-node 1" in proc.stdout and "--no-python python train.py" in proc.stdout
    assert (
        "allocation: 1 node x no GPUs (CPU nodes) (whole nodes)" in proc.stderr
        and "dry run: nothing submitted" in proc.stderr
    )
    assert not run_dir(cluster, "dry").exists()


def git_commit(project: Path) -> str:
    """Make project a git checkout with its files committed; the commit."""
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the user's project"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def test_ssh_exec_and_alloc_reach_the_nodes_and_a_running_allocation(cluster, cluster_file, tmp_path, monkeypatch):
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
    commit = git_commit(tmp_path)
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(61)\n")  # a change not committed: dirty
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(tmp_path), "--nodes", "2", "--detach"]
    started = cli(*launch, "--run-id", "held", "--", "python", "wait.py")
    assert started.returncode == 0, started.stderr
    job = started.stdout.strip()
    monkeypatch.setenv("HELD_TOKEN", "never-kept")
    queued = cli(*launch, "--run-id", "held-2", "--secret", "HELD_TOKEN", "--", "python", "wait.py")  # waits
    assert queued.returncode == 0, queued.stderr
    assert (run_dir(cluster, "held-2") / "secrets" / "env").is_file()
    # job.json records the user's project's revision beside this tool's
    recorded = json.loads((run_dir(cluster, "held") / "job.json").read_text())
    assert recorded["workdir_git"] == {"commit": commit, "dirty": True} and recorded["git_revision"]
    try:
        wait_for(lambda: (run_dir(cluster, "held") / "nodes").exists(), 60, "the job to start", interval=0.5)
        on_node = cli("ssh", "--cluster", str(cluster_file), "node-1", "--", "hostname")
        assert (on_node.returncode, on_node.stdout) == (0, "node-1\n"), on_node.stderr
        line = cli("ssh", "--cluster", str(cluster_file), "node-1", "--", "hostname; echo $((6 * 7))")
        assert (line.returncode, line.stdout) == (0, "node-1\n42\n"), line.stderr  # one shell line, as ssh runs it
        first = cli("ssh", "--cluster", str(cluster_file), "held", "--", "hostname")  # a job: its first node
        assert (first.returncode, first.stdout) == (0, "node-0\n"), first.stderr
        inside = cli("exec", "--cluster", str(cluster_file), job, "--", "sh", "-c", 'echo "$SLURM_JOB_ID $(hostname)"')
        assert inside.returncode == 0 and sorted(inside.stdout.splitlines()) == [
            f"0: {job} node-0",
            f"1: {job} node-1",
        ], inside.stderr
    finally:
        cancelled = cli("cancel", "--cluster", str(cluster_file), job, "held-2")  # several at once
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"job {job} (run held) cancelled" in cancelled.stderr and "(run held-2) cancelled" in cancelled.stderr
    assert not (run_dir(cluster, "held-2") / "secrets").exists()  # cancelled before it started: no job.sh ran
    ended = cli("exec", "--cluster", str(cluster_file), job, "--", "true")
    assert ended.returncode == 2 and "is not running" in ended.stderr
    nowhere = cli("ssh", "--cluster", str(cluster_file), "node-9", "--", "true")
    assert nowhere.returncode == 2 and nowhere.stderr.strip().endswith(
        f"node-9 is neither a node of cluster {cluster.name} (node-0, node-1) nor a job or a run "
        "(`dtrain jobs` lists them)"
    ), nowhere.stderr
    held = cli("alloc", "--cluster", str(cluster_file), "--nodes", "2", "--time", "5", "--", "srun", "hostname")
    assert held.returncode == 0 and sorted(held.stdout.split()) == ["node-0", "node-1"], held.stderr
    assert "time limit 5" in held.stderr


def test_an_image_of_the_users_choice_runs_the_code_with_only_the_jobs_gpus(tmp_path, cluster_file):
    """The docker runtime (Azure's), as far as it goes without docker: the batch script and the price."""
    desc = from_stack_outputs(OUTPUTS, "dev", private_key_file(tmp_path), known_hosts=tmp_path / "known_hosts")
    azure = desc.save(tmp_path / "cluster-dev.json")
    image = "nvcr.io/nvidia/pytorch:25.01-py3"
    launch = ["launch", "--workdir", str(REPO / "examples" / "ddp"), "--image", image, "--gpus", "2", "--dry-run"]
    proc = cli(*launch, "--cluster", str(azure), "--", "python", "train.py")
    assert proc.returncode == 0, proc.stderr
    assert f"{DOCKER_RUN_WITH_JOB_GPUS} --rm" in proc.stdout and f" {image} sh -c " in proc.stdout
    assert "#SBATCH --gres=gpu:2\n" in proc.stdout and "--exclusive" not in proc.stdout
    price = node_hour_price(desc)[0]
    assert f"estimated cost: ${price * 2 / desc.gpus_per_node:,.2f}/hour" in proc.stderr  # 2 of the node's GPUs
    host = cli(*launch, "--cluster", str(cluster_file), "--", "python", "train.py")  # the local cluster runs on hosts
    assert host.returncode == 2 and "--image runs the job in a container" in host.stderr
