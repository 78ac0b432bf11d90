"""The batch script (job.sh) of every launcher and runtime: valid bash (shellcheck), and the Slurm
requests, launch lines and clean-up each case needs. Runs for real in test_launcher.py (host runtime)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest

from dtrain.jobs.batch_script import DOCKER_RUN_WITH_JOB_GPUS, IGNORING_USR1, ONE_TASK_PER_NODE, render_job_script
from dtrain.jobs.job_spec import JobSpec, LocalCopy, ResultsTarget, Tracking
from infra.health_thresholds import LOCAL_HEALTH, node_health

BASE = JobSpec(
    run_id="r-1",
    run_dir="/shared/runs/r-1",
    launcher="horovodrun",
    nodes=2,
    processes_per_node=8,
    gpus_per_node=8,
    partition="gpu",
    command=["python3", "-m", "training.pytorch", "--data-dir", "/shared/data/my set", "--metrics-json", "/m.json"],
    workdir="/workspace",
    python="python3",
    remote_python="python3",
    results=ResultsTarget("https://acct.blob.core.windows.net", "results", client_id="0000-1111"),
    image="acr.azurecr.io/hvd-pytorch:latest",
    network_interface="eth0",
    infiniband=True,
    env={"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0"},
)
VARIANTS = {
    "horovod-docker": BASE,
    "horovod-host": replace(BASE, image=None, python="/opt/venv/bin/python", gpus_per_node=0),
    "torchrun-docker": replace(BASE, launcher="torchrun", requeue=True, time_limit="90"),
    "torchrun-host": replace(BASE, launcher="torchrun", image=None, python="/opt/venv/bin/python"),
    "local-copy": replace(BASE, local_copy=LocalCopy("/shared/data/my set", "/nvme/data/my set")),
    # a task file's parts (dtrain/jobs/task_steps.py): setup, secrets, per-node mode
    "task-per-node-docker": replace(
        BASE, mode="per-node", setup_cache_dir="/nvme/data/.dtrain-setup", secrets=("HF_TOKEN",), requeue=True
    ),
    "task-per-node-host": replace(
        BASE, mode="per-node", image=None, python="/opt/venv/bin/python", setup_cache_dir="/x", secrets=("A",)
    ),
    "task-horovod-secrets": replace(BASE, image=None, secrets=("A", "B"), requeue=True),
    "task-per-rank-setup": replace(BASE, launcher="torchrun", setup_cache_dir="/x", cluster_info='{"cloud": "Azure"}'),
    "tracked": replace(BASE, tracking=Tracking("http://10.40.63.254:5000", "my experiment")),
    "resume-and-warn": replace(BASE, launcher="torchrun", resume_from="old-run", warn_before_s=300, time_limit="60"),
    "warn-host": replace(BASE, image=None, warn_before_s=30, time_limit="1"),
    "gated-docker": replace(BASE, gate=node_health("Standard_ND96isr_H100_v5").gate, secrets=("A",)),
    "gated-host-per-node": replace(BASE, image=None, mode="per-node", gate=LOCAL_HEALTH.gate),
    "local-sas": replace(
        BASE, image=None, results=ResultsTarget("http://127.0.0.1:1/devstoreaccount1", "results", sas_file="r.sas")
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_passes_shellcheck(name, tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed: run `make setup`")
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(VARIANTS[name]))
    proc = subprocess.run(["shellcheck", "--severity=info", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_slurm_request_follows_the_spec():
    text = render_job_script(VARIANTS["torchrun-docker"])
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --time=90",
        "#SBATCH --output=/shared/runs/r-1/output.log",
        "#SBATCH --open-mode=append",
    ):
        assert line in text.splitlines()
    host = render_job_script(VARIANTS["horovod-host"])
    assert "#SBATCH --no-requeue" in host and "--gres" not in host


def test_horovod_on_the_host_reaches_other_nodes_through_srun():
    text = render_job_script(VARIANTS["horovod-host"])
    assert 'ln -sf ../srun_ssh.py "$TOOLS/bin/ssh"' in text
    assert 'PATH="$TOOLS/bin:/opt/venv/bin:$PATH" horovodrun --gloo -np 16' in text
    assert "'/shared/data/my set'" in text  # a job argument with a space stays one word


def test_containers_are_labelled_for_the_epilog_and_get_the_devices():
    text = render_job_script(VARIANTS["horovod-docker"])
    assert '--label "slurm.job=$SLURM_JOB_ID"' in text
    assert DOCKER_RUN_WITH_JOB_GPUS in text and "--device /dev/infiniband" in text
    assert "-e NCCL_IB_HCA" in text and "-p 12345" in text
    torchrun = render_job_script(VARIANTS["torchrun-docker"])
    assert "srun --label --overlap --kill-on-bad-exit=1" in torchrun and "--rdzv-id" in torchrun


def test_results_are_uploaded_with_the_identity_or_the_sas_file():
    assert "--managed-identity --client-id 0000-1111" in render_job_script(BASE)
    local = render_job_script(VARIANTS["local-sas"])
    assert '--sas-file "$RUN_DIR"/r.sas' in local and "--managed-identity" not in local


def test_exit_trap_writes_the_status_then_uploads():
    text = render_job_script(BASE)
    assert text.index("trap finish EXIT") < text.index("horovodrun --gloo")
    start = text.index("finish() {")
    body = text[start : text.index("\n}\n", start)]
    uploading, upload = body.index('write_status "$code" uploading'), body.index("upload_results.py")
    # upload_results.py sets the outcome in status.json, and uploads it last: no later write_status
    assert uploading < upload and "--status status.json" in body and body.count("write_status") == 1


def test_every_attempt_is_recorded_before_the_upload_and_the_job_knows_its_run_and_revision():
    spec = replace(VARIANTS["horovod-docker"], git_revision="0123abcd")
    text = render_job_script(spec)
    assert "export RUN_DIR=/shared/runs/r-1 RUN_ID=r-1 GIT_REVISION=0123abcd" in text
    # the containers see them too (the model export records both)
    assert "-e RUN_ID -e GIT_REVISION" in text
    record, upload = text.index("record_run.py"), text.index('upload_results.py" --dir')
    assert record < upload and '--nodes 2 --attempt "$ATTEMPT"' in text[record - 200 : upload]


def test_local_copy_runs_once_per_node_before_training_and_a_failure_ends_the_job():
    script = render_job_script(VARIANTS["local-copy"])
    lines = script.splitlines()
    (copy,) = [i for i, line in enumerate(lines) if "nvme_copy.py" in line]
    launch = next(i for i, line in enumerate(lines) if "horovodrun" in line and "--gloo" in line)
    assert copy < launch
    assert '--ntasks-per-node=1 "$PY" "$TOOLS/nvme_copy.py"' in lines[copy]
    assert "--source '/shared/data/my set' --dest '/nvme/data/my set'" in lines[copy]
    assert lines[copy].endswith("failed: training not started'; exit 1; }")
    # the containers see the copy, read-only
    assert "-v '/nvme/data/my set':'/nvme/data/my set':ro" in script
    assert "nvme_copy.py" not in render_job_script(BASE)


def test_a_multi_node_job_measures_its_nodes_first_in_the_training_environment():
    """The gate (dtrain/jobs/node_gate.py) runs before the local copy, setup and launch, once per node, with
    the cluster's thresholds; it requeues the job when a node fails, and a one-node job has none."""
    gated = replace(VARIANTS["gated-docker"], local_copy=LocalCopy("/shared/data/s", "/nvme/data/s"))
    lines = render_job_script(gated).splitlines()
    (gate,) = [i for i, line in enumerate(lines) if "node_gate.py" in line]
    copy = next(i for i, line in enumerate(lines) if "nvme_copy.py" in line)
    assert gate < copy
    assert "--ntasks-per-node=1" in lines[gate] and "--kill-on-bad-exit=0" in lines[gate]
    # in the job's image, on the GPUs Slurm gave it, told its node's index
    assert DOCKER_RUN_WITH_JOB_GPUS in lines[gate] and "-e SLURM_NODEID" in lines[gate]
    # a TensorFlow job's image has no torch: the gate runs in PyTorch's
    tensorflow = replace(gated, image="acr.azurecr.io/hvd-tensorflow:1", gate_image="acr.azurecr.io/hvd-pytorch:1")
    (gate_line,) = [line for line in render_job_script(tensorflow).splitlines() if "node_gate.py" in line]
    assert "acr.azurecr.io/hvd-pytorch:1" in gate_line and "hvd-tensorflow" not in gate_line
    assert "--node-figure allreduce --node-min 230 --link-min 23.75 --job-min 150" in lines[gate]
    script = "\n".join(lines)
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "REQUEUED=1" in script
    host = render_job_script(VARIANTS["gated-host-per-node"])
    assert "--node-figure matmul" in host and f'{IGNORING_USR1} env python3 "$TOOLS/node_gate.py"' in host
    assert "node_gate.py" not in render_job_script(replace(VARIANTS["gated-docker"], nodes=1))
    assert "node_gate.py" not in render_job_script(BASE)


def test_a_container_gets_only_the_gpus_slurm_gave_the_job_on_its_node(tmp_path):
    """docker run --gpus "device=<the step's GPUs>", read on the node (a stand-in docker prints its argv)."""
    (tmp_path / "docker").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (tmp_path / "docker").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_GPUS": "0,1,2", "SLURM_STEP_GPUS": "3,5"}
    proc = subprocess.run(
        f"{DOCKER_RUN_WITH_JOB_GPUS} --rm image:tag", shell=True, env=env, capture_output=True, text=True
    )
    assert proc.stdout.splitlines() == ["run", "--gpus", '"device=3,5"', "--rm", "image:tag"], proc.stderr


def test_a_job_shares_its_nodes_unless_it_asks_for_whole_ones():
    shared = render_job_script(replace(BASE, gpus_per_node=2))
    assert "#SBATCH --gres=gpu:2" in shared and "--exclusive" not in shared
    assert "--mem" not in shared  # its GPUs' share of the memory: the partition's DefMemPerGPU
    # a whole node's memory too: --exclusive alone gives only the default share where memory is consumable
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n" in render_job_script(replace(BASE, exclusive=True))
    assert 'export OUTPUT_DIR="$RUN_DIR/output" CHECKPOINT_DIR="$RUN_DIR/checkpoints"' in shared


def test_the_nodes_nccl_topology_file_is_mounted_read_only_where_nccl_is_told_to_read_it():
    topology = "/opt/microsoft/ndv5-topo.xml"
    spec = replace(BASE, env={**BASE.env, "NCCL_TOPO_FILE": topology})
    for launcher in ("horovodrun", "torchrun"):
        script = render_job_script(replace(spec, launcher=launcher))
        assert f"-v {topology}:{topology}:ro" in script and "-e NCCL_TOPO_FILE" in script
    assert "/opt/microsoft" not in render_job_script(BASE)  # only when the SKU names one


def test_the_time_warning_reaches_the_ranks_on_the_host_or_inside_the_job_container():
    """The forwarder runs on every node as one step whose tasks ignore USR1 (its srun passes the signal
    on); the ranks of the docker runtime run as root in the container: the forwarder runs in there too."""
    host = render_job_script(VARIANTS["warn-host"])
    assert "#SBATCH --signal=B:USR1@30\n" in host
    every_node = f"{{ exec srun --overlap --quiet {ONE_TASK_PER_NODE} {IGNORING_USR1} "
    forward = '"$PY" "$TOOLS/time_warning.py" --job "$SLURM_JOB_ID" --skip $$ --skip "$BASHPID" --skip-on'
    summary = '; } | "$PY" "$TOOLS/time_warning.py" --summarize "$SLURM_JOB_NUM_NODES" &\n'
    assert f"  {every_node}{forward}" in host and summary in host
    docker = render_job_script(VARIANTS["resume-and-warn"])
    forward = 'docker exec -e SLURMD_NODENAME "hvd-$SLURM_JOB_ID" python3 "$TOOLS/time_warning.py" --job'
    assert f"  {every_node}{forward}" in docker and summary in docker
    # set once the launch has started (its processes keep ignoring USR1), before the job is waited for
    assert docker.index("STEP_PID=$!") < docker.index("trap time_warning USR1") < docker.index('until wait "$STEP_PID"')
    # and a warning Slurm sent before the trap (USR1 ignored until then) is passed on as it is set
    assert "trap time_warning USR1\ntime_warning\n" in docker
    assert "--signal" not in render_job_script(BASE)


def test_a_resumed_job_fetches_its_checkpoint_first_and_the_mirror_runs_beside_it():
    script = render_job_script(VARIANTS["resume-and-warn"])
    fetch, mirror = script.index('fetch_checkpoint.py" --run old-run'), script.index("MIRROR_PID=$!")
    assert script.index("finish() {") < fetch < mirror < script.index("torchrun --nnodes")
    assert "--managed-identity --client-id 0000-1111" in script[fetch : script.index("\n", fetch)]
    # at the end: the mirror stops, and the results upload makes its last pass
    assert script.index('kill "$MIRROR_PID"') < script.index('upload_results.py" --dir')
    assert "--status status.json --with-checkpoints" in script
    assert "fetch_checkpoint.py" not in render_job_script(BASE)


def test_what_setup_and_the_launch_print_reaches_the_log_with_the_secrets_masked():
    """dtrain/remote/job/job_secrets.py: setup's lines through its filter, the launch's through annotate_output.py."""
    text = render_job_script(VARIANTS["task-per-node-host"])
    (setup,) = [line for line in text.splitlines() if "setup_once.py" in line]
    # the whole pipe runs as one step in the background (run_step eval), so a TERM is handled at once
    assert setup.startswith("run_step eval ") and setup.endswith("; exit $code; }"), setup
    assert '2>&1 | "$PY" "$TOOLS/job_secrets.py" /shared/runs/r-1/secrets/env\' || {' in setup
    assert '--verdict "$RUN_DIR/verdict.json" --secrets /shared/runs/r-1/secrets/env &' in text
    plain = render_job_script(replace(VARIANTS["task-per-node-host"], secrets=()))
    assert "job_secrets.py" not in plain and "--secrets" not in plain
