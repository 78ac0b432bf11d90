"""A job ended by its time limit keeps its record, on the local cluster's real Slurm, Azurite and MLflow:
its run.json, logs, outputs and last checkpoint reach the results container and its MLflow run is closed,
whether or not it caught the time warning; a setup that runs into the limit is reported as the limit's.

No bound here is a guess: each is the time limit of the job, Slurm's own slack in enforcing it, the kill
wait the closing step runs in (both from the product's settings), and a margin for a loaded machine."""

from __future__ import annotations

import json

from dtrain.cluster.blobs import container_client
from dtrain.jobs import time_warning
from dtrain.local.slurm_conf import KILL_WAIT_S
from tests.polling import wait_for

from .test_launcher import cli, job_id_of, run_dir, squeue_state, status_of
from .test_mlflow import api, mlflow_run_of, server

TIME_LIMIT = "1"  # minutes: the shortest Slurm has
LIMIT_CHECK_S = 60  # slurmctld enforces time limits on a periodic pass: up to this late
START_MARGIN_S = 180  # a job's start (and a cluster's MLflow server) on a loaded 2-core machine
END_BOUND_S = 60 + LIMIT_CHECK_S + KILL_WAIT_S + START_MARGIN_S

# The user's job: an output and a checkpoint at once, then it sleeps past its time limit. With
# "catch-warning" it saves a second checkpoint when warned; with "stop-on-warning" it then exits 75 as our
# bundled trainers do (PREEMPTED: saved, stopping); with "hold-on-term" it goes on after SIGTERM, as a job
# does that saves a large checkpoint then, or hangs in a collective: Slurm's SIGKILL ends it.
OWN_JOB = """
import os, signal, sys, time
out, ckpt = os.environ["OUTPUT_DIR"], os.environ["CHECKPOINT_DIR"]
def save(name):
    with open(os.path.join(ckpt, ".tmp"), "w") as handle:
        handle.write(name)
    os.replace(os.path.join(ckpt, ".tmp"), os.path.join(ckpt, name))
    print("saved", name, flush=True)
if "catch-warning" in sys.argv:
    signal.signal(signal.SIGUSR1, lambda *_: save("warned.ckpt"))
if "stop-on-warning" in sys.argv:
    signal.signal(signal.SIGUSR1, lambda *_: (save("warned.ckpt"), sys.exit(75)))
if "hold-on-term" in sys.argv:
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM: going on", flush=True))
with open(os.path.join(out, "metrics.txt"), "w") as handle:
    handle.write("loss 0.1\\n")
save("first.ckpt")
while True:
    time.sleep(1)
"""


def launch_detached(cluster_file, workdir, run_id: str, behaviour: str, flags: tuple[str, ...] = ()) -> str:
    """OWN_JOB as run_id, under --time TIME_LIMIT, told how to behave; its Slurm job id."""
    workdir.mkdir()
    (workdir / "job.py").write_text(OWN_JOB)
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(workdir), "--run-id", run_id]
    proc = cli(*launch, "--time", TIME_LIMIT, *flags, "--detach", "--", "python", "job.py", behaviour)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return job_id_of(proc)


def assert_the_record_is_kept(cluster, job_id: str, run_id: str, expected: set[str], exit_code: int = 143) -> None:
    """The run's status says its time limit ended it (with exit_code); expected (names under the run's
    prefix) and its run.json are in the results container; its MLflow run is closed as KILLED."""
    # the batch script has ended (closed the run, or been killed) once Slurm lets the job go
    wait_for(lambda: not squeue_state(cluster, job_id), END_BOUND_S, f"job {job_id} to leave the queue", 1)
    status = status_of(cluster, run_id)
    log = (run_dir(cluster, run_id) / "output.log").read_text()
    assert status, f"{run_id} has no final status.json: {log[-3000:]}"
    assert (status["exit_code"], status["ended_by"], status["results"]) == (exit_code, "time_limit", "uploaded"), log
    container = container_client(cluster.results)
    blobs = {blob.name.removeprefix(f"{run_id}/") for blob in container.list_blobs(name_starts_with=f"{run_id}/")}
    assert {"run.json", "status.json", "output.log", *expected} <= blobs, (sorted(blobs), log[-3000:])
    record = json.loads(container.download_blob(f"{run_id}/run.json").readall())
    assert record["attempts"][-1]["exit_code"] == exit_code, record
    mlflow_run = api(server(cluster), "runs/get", run_id=mlflow_run_of(cluster, run_id))["run"]
    assert mlflow_run["info"]["status"] == "KILLED", mlflow_run


def test_a_job_ended_by_its_time_limit_keeps_its_record_with_and_without_the_warning(cluster, cluster_file, tmp_path):
    server(cluster)  # the job's run is opened at its start: the server must be up by then
    assert time_warning.warning_lead(None, TIME_LIMIT) > 0  # the default: a warning the job catches
    caught = launch_detached(cluster_file, tmp_path / "caught", "limit-caught", "catch-warning")
    stopped = launch_detached(cluster_file, tmp_path / "stopped", "limit-stopped", "stop-on-warning")
    unwarned = launch_detached(
        cluster_file, tmp_path / "held", "limit-unwarned", "hold-on-term", ("--warn-before", "0")
    )
    outputs = {"output/metrics.txt", "logs/rank-0.log", "checkpoints/first.ckpt"}
    assert_the_record_is_kept(cluster, caught, "limit-caught", {*outputs, "checkpoints/warned.ckpt"})
    assert_the_record_is_kept(cluster, stopped, "limit-stopped", {*outputs, "checkpoints/warned.ckpt"}, 75)
    assert_the_record_is_kept(cluster, unwarned, "limit-unwarned", outputs)


def test_a_setup_that_runs_into_the_time_limit_is_reported_as_the_limits_and_keeps_its_record(
    cluster, cluster_file, tmp_path
):
    server(cluster)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('never run')\n")
    task = tmp_path / "task.yaml"
    # a setup that hangs, and takes no notice of SIGTERM (a download stuck on a dead mount, say)
    task.write_text("workdir: code\nsetup: trap '' TERM; echo installing; sleep 1000\nrun: python train.py\n")
    launch = ["launch", str(task), "--cluster", str(cluster_file), "--run-id", "limit-setup", "--time", TIME_LIMIT]
    proc = cli(*launch, "--follow", timeout=END_BOUND_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-3000:]
    assert "(run limit-setup): its time limit (1) ended it" in out, out[-3000:]
    assert "setup failed" not in out and "cancelled before it started" not in out, out[-3000:]
    assert_the_record_is_kept(cluster, job_id_of(proc), "limit-setup", set())


def test_a_warning_slurm_sent_during_the_setup_still_reaches_the_ranks(cluster, cluster_file, tmp_path):
    """Slurm signals the batch script once; before the launch (a setup, a local copy, the gate) it ignores
    USR1, so the launch passes on a warning that is due by then."""
    server(cluster)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "warned.py").write_text(
        "import os, signal, sys, time\n"
        "def warned(*_):\n"
        "    open(os.path.join(os.environ['OUTPUT_DIR'], 'warned'), 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, warned)\n"
        "time.sleep(150)\n"
    )
    task = tmp_path / "task.yaml"
    # with --time 2 and the warning 100 s before the limit, slurmctld's first periodic pass (every 30 s,
    # sending up to 30 s early) signals at once: the setup outlasts it
    task.write_text("workdir: code\nsetup: sleep 50\nrun: python warned.py\n")
    launch = ["launch", str(task), "--cluster", str(cluster_file), "--run-id", "warned-in-setup"]
    proc = cli(*launch, "--time", "2", "--warn-before", "100", "--follow", timeout=120 + END_BOUND_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert (run_dir(cluster, "warned-in-setup") / "output" / "warned").exists(), out[-3000:]
    assert "[job] time warning: SIGUSR1 sent to 1 processes on 1 of 1 node(s)" in out, out[-3000:]
