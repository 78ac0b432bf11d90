"""Checkpoints that outlive the cluster, for any code, on the local cluster's real Slurm and Azurite:
what a job writes to $CHECKPOINT_DIR is in the results container while it still runs, a new run resumes
from it with the bytes going from storage to the cluster only, and a job warned of its time limit saves
a checkpoint (the Spot eviction's path) before the limit ends it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from dtrain.cluster.blobs import container_client
from dtrain.cluster.description import ClusterDescription
from tests.polling import wait_for
from training.checkpoint.files import read_checkpoint

from .conftest import REPO
from .test_launcher import cli, run_dir, status_of

SIZE = 96 * 2**20  # far more than the operator's process reads and writes in a launch of its own
OWN_JOB = f"""
import hashlib, json, os, sys, time
ckpt, out, run = (os.environ[name] for name in ("CHECKPOINT_DIR", "OUTPUT_DIR", "RUN_DIR"))
state = os.path.join(ckpt, "state.bin")
if os.path.exists(state):  # resumed (launch --resume-from): say what it found
    with open(state, "rb") as handle:
        found = hashlib.sha256(handle.read()).hexdigest()
    with open(os.path.join(out, "resumed.json"), "w") as handle:
        json.dump({{"sha256": found}}, handle)
    sys.exit(0)
with open(os.path.join(ckpt, ".state.bin.tmp"), "wb") as handle:  # written, then renamed into place
    handle.write(os.urandom({SIZE}))
os.replace(os.path.join(ckpt, ".state.bin.tmp"), state)
print("checkpoint saved", flush=True)
while not os.path.exists(os.path.join(run, "release")):  # the test lets it end
    time.sleep(0.5)
"""
# The operator's own I/O while it launches: /proc/self/io of its process when it exits (its ssh and rsync
# are children of their own, so what it sends them is in wchar, what it reads from storage in rchar).
METER = (
    "import atexit, runpy, sys; "
    "atexit.register(lambda: sys.stderr.write('\\nIO ' + open('/proc/self/io').read().replace('\\n', ' ') + '\\n')); "
    "sys.argv = ['dtrain', *sys.argv[1:]]; runpy.run_module('dtrain', run_name='__main__', alter_sys=True)"
)


def metered_cli(*args: str) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", METER, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    line = re.search(r"^IO (.*)$", proc.stderr, re.M)
    assert line, proc.stderr[-3000:]
    words = line.group(1).split()
    return proc, {key.rstrip(":"): int(value) for key, value in zip(words[::2], words[1::2], strict=True)}


def test_own_code_checkpoints_reach_storage_while_it_runs_and_a_new_run_resumes_from_them(
    cluster, cluster_file, tmp_path
):
    kept = keep_own_checkpoint(cluster, cluster_file, tmp_path, "kept-own")
    # the cluster keeps no copy: what the new run finds comes from the results container
    shutil.rmtree(run_dir(cluster, "kept-own") / "checkpoints")
    resume_own_checkpoint(cluster, cluster_file, tmp_path, "kept-own", "kept-own-2", kept)
    # a new cluster sharing the storage: test_spot.py's test_a_run_resumes_on_a_fresh_cluster_...


def keep_own_checkpoint(desc: ClusterDescription, cluster_file: Path, workdir: Path, run_id: str) -> bytes:
    """Run OWN_JOB until its checkpoint is in the results container (while it still runs), then let it
    end; the checkpoint's bytes."""
    (workdir / "ckpt.py").write_text(OWN_JOB)
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(workdir)]
    first = cli(*launch, "--run-id", run_id, "--detach", "--", "python", "ckpt.py")
    assert first.returncode == 0, first.stderr
    container = container_client(desc.results)
    blob = f"{run_id}/checkpoints/state.bin"
    wait_for(lambda: container.get_blob_client(blob).exists(), 180, "the checkpoint in the results container", 1)
    assert status_of(desc, run_id) is None  # the job still runs: it waits for `release`
    kept = container.download_blob(blob).readall()
    assert len(kept) == SIZE
    assert not [b.name for b in container.list_blobs(name_starts_with=f"{run_id}/checkpoints/.")]  # no temp file
    (run_dir(desc, run_id) / "release").touch()
    ended = wait_for(lambda: status_of(desc, run_id), 120, "the first run to end", 1)
    assert ended["exit_code"] == 0, ended
    return kept


def resume_own_checkpoint(
    desc: ClusterDescription, cluster_file: Path, workdir: Path, old: str, new: str, kept: bytes
) -> None:
    """`launch --resume-from old`: OWN_JOB in run new finds the checkpoint kept, which went from storage
    to the cluster without passing through the operator's process."""
    (workdir / "ckpt.py").write_text(OWN_JOB)
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(workdir)]
    proc, io = metered_cli(*launch, "--run-id", new, "--resume-from", old, "--detach", "--", "python", "ckpt.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert io["rchar"] < SIZE // 2 and io["wchar"] < SIZE // 2, io  # the checkpoint did not pass through
    resumed = wait_for(lambda: status_of(desc, new), 180, "the resumed run to end", 1)
    log = (run_dir(desc, new) / "output.log").read_text()
    assert resumed["exit_code"] == 0, log[-3000:]
    found = json.loads((run_dir(desc, new) / "output" / "resumed.json").read_text())
    assert found["sha256"] == hashlib.sha256(kept).hexdigest()
    assert f"fetched 1 files (100.7 MB) of {old}'s checkpoints" in log, log[-3000:]


def test_a_job_warned_of_its_time_limit_saves_a_checkpoint_before_it_ends(cluster, cluster_file):
    job_args = ["--data", "synthetic", "--model", "simple_cnn", "--image-size", "32", "--batch-size", "8"]
    job_args += ["--steps", "1000000", "--checkpoint-every", "1000000", "--log-every", "50", "--warmup-epochs", "0"]
    launch = ["launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--nodes", "1", "--run-id", "warned"]
    # the warning comes up to a minute early: --time 2, so that the job has started by then on a busy machine
    proc = cli(*launch, "--time", "2", "--warn-before", "60s", "--follow", "--", *job_args)
    out = proc.stdout + proc.stderr
    assert "#SBATCH --signal=B:USR1@60" in (run_dir(cluster, "warned") / "job.sh").read_text()
    assert "asking the job to save a checkpoint (SIGUSR1)" in out, out[-3000:]
    match = re.search(r"error: preempted \(SIGUSR1: [^)]*\) after step (\d+): saved the checkpoint", out)
    assert match, out[-3000:]
    step = int(match.group(1))
    # saved through the Spot eviction's path: a whole checkpoint of that step, the model's own
    saved = run_dir(cluster, "warned") / "checkpoints" / f"ckpt-{step:010d}.ckpt"
    assert read_checkpoint(saved).step == step
    assert container_client(cluster.results).get_blob_client(f"warned/checkpoints/{saved.name}").exists()
    # and the run reads as ended by its time limit, as one that the limit killed does
    assert proc.returncode == 75, out[-3000:]
    assert "(run warned): its time limit (2) ended it; ask for more with --time" in proc.stderr, out[-3000:]
    assert status_of(cluster, "warned")["ended_by"] == "time_limit"
    rows = json.loads(cli("jobs", "--cluster", str(cluster_file), "--json").stdout)["jobs"]
    row = next(row for row in rows if row["run"] == "warned")
    assert (row["state"], row["note"]) == ("TIMEOUT", "its time limit (2) ended it")
