"""`launch TASK.yaml`: a task file (setup, envs, secrets, resources, per-node mode) on the local cluster's
real Slurm, its schema's errors, and the refusal of a launcher started once per rank (dtrain/jobs/task_file.py,
dtrain/jobs/launcher_guard.py, dtrain/jobs/task_steps.py)."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from dtrain.__main__ import main
from dtrain.cluster.description import from_stack_outputs
from dtrain.jobs.launcher_guard import launcher_in

from .conftest import REPO, local_state_dir, private_key_file, run_module
from .test_cluster_description import OUTPUTS
from .test_launcher import TRAIN_PYTHON, results_blobs, run_dir, status_of

EXAMPLE = REPO / "examples" / "torchrun"
# every rank's weights equal to rank 0's (in the training environment: the operator's has no torch)
SAME_WEIGHTS = """
import sys, torch
first, *others = [torch.load(path) for path in sys.argv[1:]]
assert others and all(torch.equal(o[k], first[k]) for o in others for k in first), "the replicas differ"
"""


def launch(*args: str, env: dict | None = None):
    return run_module("dtrain", "launch", *args, env=env)


def checked(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """`launch ARGS` in this process (quick: the checks and --dry-run connect to nothing)."""
    code = main(["launch", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def azure_file(tmp_path: Path) -> Path:
    """An Azure cluster's description: enough for checks and --dry-run, which connect to nothing."""
    desc = from_stack_outputs(OUTPUTS, "dev", private_key_file(tmp_path), known_hosts=tmp_path / "known_hosts")
    return desc.save(tmp_path / "cluster-dev.json")


def task(tmp_path: Path, text: str) -> Path:
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "code" / "train.py").write_text("print('hello')\n")
    path = tmp_path / "task.yaml"
    path.write_text(text)
    return path


MAPPING = "workdir: code\nrun: python train.py\n"
BAD_TASKS = {
    MAPPING + "resources:\n  gpus: 0\n": "resources.gpus: Input should be greater than or equal to 1",
    MAPPING + "resources:\n  gpu: 2\n": "resources.gpu: Extra inputs are not permitted",
    MAPPING + "envs:\n  2BAD: x\n": "envs.2BAD.[key]: String should match pattern",
    MAPPING + "envs:\n  A: [1]\n": "envs: A: a value must be text, a number or true/false",
    MAPPING + "secrets: [HF TOKEN]\n": "secrets.0: String should match pattern",
    MAPPING + "secrets: {HF_TOKEN: hf_abc}\n": "secrets: HF_TOKEN: leave the value empty (null)",
    MAPPING + "mode: per-gpu\n": "mode: Input should be 'per-rank' or 'per-node'",
    MAPPING + "resources:\n  time: soon\n": "resources.time: invalid time limit 'soon'",
    MAPPING + "name: a/b\n": "name: String should match pattern",
    MAPPING + "run: [1\n": "not YAML at line 4",
    "- run\n": "expected a mapping of keys",
    "run: python train.py\n": "workdir: needed",
    # PyYAML keeps the last of two equal keys: the first `run:` would be dropped without a word
    MAPPING + "run: python other.py\n": "not YAML at line 3, column 1: duplicate key 'run' (the second would",
    MAPPING + "envs: {A: 1, A: 2}\n": "not YAML at line 3, column 14: duplicate key 'A'",
    # a value of the wrong type is named, not converted (true would be 1 node, "2" would be 2)
    MAPPING + "resources: {nodes: true}\n": "resources.nodes: Input should be a valid integer",
    MAPPING + "resources: {nodes: '2'}\n": "resources.nodes: Input should be a valid integer",
    MAPPING + "resources: {spot: 'yes'}\n": "resources.spot: Input should be a valid boolean",
}
MAPPING_CHECKS = {  # checked with the flags that add to them, so named without the file
    MAPPING + "envs: {MASTER_PORT: 1}\n": "MASTER_PORT: the job sets this variable itself",
    MAPPING + "secrets: [SLURM_JOB_ID]\n": "SLURM_JOB_ID: the job sets this variable itself",
    MAPPING + "envs: {A: 1}\nsecrets: [A]\n": "A: both an env and a secret: keep one",
    MAPPING + "envs: {WANDB_API_KEY: k-123}\n": "WANDB_API_KEY: a credential's name",
    # the job sets MLflow's variables: an env of the same name was silently overridden
    MAPPING + "envs: {MLFLOW_TRACKING_URI: http://x:5000}\n": "MLFLOW_TRACKING_URI: the job sets MLflow's",
    MAPPING + "envs: {MLFLOW_TRACKING_TOKEN: t}\n": "MLFLOW_TRACKING_TOKEN: a credential's name",
    # envs reach the job's own tools: PYTHONHOME broke every upload, a proxy for pip turned MLflow off
    MAPPING + "envs: {PYTHONHOME: /opt/py}\n": "PYTHONHOME: an env reaches the job's own tools too",
    MAPPING + "envs: {http_proxy: http://proxy:3128}\n": "http_proxy: an env reaches the job's own tools too",
    # what every command of the batch script carries: 200 KiB made each fail with "Argument list too long"
    MAPPING + f"envs: {{BIG: {'x' * 200 * 1024}}}\n": "BIG: 200.0 KiB; a job's envs and secrets hold at most 64 KiB",
    MAPPING + f"envs: {{A1: {'x' * 40 * 1024}, A2: {'x' * 40 * 1024}}}\n": "envs and secrets: 80.0 KiB together;",
    MAPPING + f"envs: {{A1: {'x' * (10 * 1024 - 3)}}}\nsecrets: [LARGE]\n": "envs and secrets: 70.0 KiB together",
}


@pytest.mark.parametrize("text", BAD_TASKS)
def test_each_mistake_in_a_task_file_is_one_error_line_naming_the_key(text, tmp_path, azure_file, capsys):
    path = task(tmp_path, text)
    code, out, err = checked(capsys, "--cluster", str(azure_file), str(path), "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {path}: {BAD_TASKS[text]}"), lines[0]
    assert out == ""  # no batch script: nothing planned


def test_any_case_of_yaml_is_a_task_file_whose_merged_keys_may_be_overridden(tmp_path, azure_file, capsys):
    (tmp_path / "code").mkdir()
    for name in ("task.YAML", "task.Yml"):
        path = tmp_path / name
        path.write_text("workdir: code\nrun: python train.py\nresources: {<<: {nodes: 2}, nodes: 1}\n")
        code, out, err = checked(capsys, "--cluster", str(azure_file), str(path), "--dry-run")
        assert code == 0, err
        assert "#SBATCH --nodes=1\n" in out and "python train.py" in out  # a merged key is not a duplicate


@pytest.mark.parametrize("text", MAPPING_CHECKS, ids=lambda text: text[len(MAPPING) :][:40])
def test_variables_the_job_sets_itself_are_refused(text, tmp_path, azure_file, capsys, monkeypatch):
    monkeypatch.setenv("A", "x")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("LARGE", "x" * (60 * 1024 - len("LARGE=")))  # with A1's 10 KiB: 70 KiB
    code, out, err = checked(capsys, "--cluster", str(azure_file), str(task(tmp_path, text)), "--dry-run")
    assert code == 2 and out == "" and err.startswith(f"error: {MAPPING_CHECKS[text]}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "name", ["MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AZURE_CLIENT_SECRET", "HF_TOKEN", "OPENAI_API_KEY"]
)
def test_a_credential_passed_as_an_env_is_refused_pointing_to_secrets(name, tmp_path, azure_file, capsys):
    """Its value would be in job.sh and job.json, which are uploaded: one error line, the value not repeated."""
    path = task(tmp_path, MAPPING)
    code, out, err = checked(capsys, "--cluster", str(azure_file), str(path), "--env", f"{name}=v-4l7e", "--dry-run")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {name}: a credential's name") and f"--secret {name}" in err and "v-4l7e" not in err


def test_names_that_only_look_like_credentials_are_plain_envs(tmp_path, azure_file, capsys):
    envs = ("TOKENIZERS_PARALLELISM=false", "MAX_TOKENS=512", "KEYBOARD=us", "SECRETS_DIR=/x")
    code, out, err = checked(
        capsys, "--cluster", str(azure_file), str(task(tmp_path, MAPPING)), *(f"--env={e}" for e in envs), "--dry-run"
    )
    assert code == 0 and "TOKENIZERS_PARALLELISM=false" in out, err


def test_a_secret_may_carry_mlflows_token_and_a_proxy_which_reach_only_the_command(
    tmp_path, azure_file, capsys, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t")
    monkeypatch.setenv("http_proxy", "http://proxy:3128")
    text = MAPPING + f"envs: {{NEAR_LIMIT: {'x' * 60 * 1024}}}\nsecrets: [MLFLOW_TRACKING_TOKEN, http_proxy]\n"
    code, out, err = checked(capsys, "--cluster", str(azure_file), str(task(tmp_path, text)), "--dry-run")
    assert code == 0, err
    assert "http://proxy:3128" not in out  # sourced from the run's secrets by the command's own wrapper


def test_flags_win_over_the_file_and_a_secret_reaches_no_output(tmp_path, azure_file, capsys, monkeypatch):
    secret = f"s3cr3t-{secrets.token_hex(8)}"
    path = task(
        tmp_path,
        "workdir: code\nsetup: echo ready\nrun: python train.py\nenvs: {EPOCHS: 3, DEBUG: true}\n"
        "secrets: [HF_TOKEN]\nresources: {nodes: 2, gpus: 4, time: 1:00:00}\n",
    )
    # every flag after the task file counts, --cluster too
    args = (str(path), "--cluster", str(azure_file), "--nodes", "1", "--env", "EPOCHS=5", "--dry-run")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    code, _, err = checked(capsys, *args)
    assert code == 2 and err.startswith("error: secret HF_TOKEN: not set in this environment"), err
    monkeypatch.setenv("HF_TOKEN", secret)
    code, out, err = checked(capsys, *args)
    assert code == 0, err
    assert secret not in out + err
    assert "#SBATCH --nodes=1\n" in out and "#SBATCH --gres=gpu:4\n" in out
    assert "#SBATCH --time=1:00:00\n" in out  # YAML 1.1 would have read 3600 (minutes)
    assert "EPOCHS=5" in out and "DEBUG=true" in out
    assert "setup_once.py" in out and "/secrets/env" in out


LAUNCHERS = [
    ("torchrun", ["torchrun", "--nproc-per-node", "2", "train.py"]),
    ("python -m torch.distributed.run", ["python3", "-m", "torch.distributed.run", "train.py"]),
    ("python -m torch.distributed.launch", ["/usr/bin/python", "-m", "torch.distributed.launch", "train.py"]),
    ("accelerate launch", ["accelerate", "launch", "train.py"]),
    ("deepspeed", ["deepspeed", "train.py"]),
    ("torchrun", ["sh", "-c", "pip install -r requirements.txt && FOO=1 torchrun train.py"]),
    ("torchrun", ["env", "OMP_NUM_THREADS=1", "torchrun", "train.py"]),
    # behind the shell's own flags, or a second shell: it got past the check
    ("torchrun", ["bash", "-lc", "cd src && torchrun train.py"]),
    ("torchrun", ["/bin/bash", "-e", "-o", "pipefail", "-c", "torchrun train.py | tee log"]),
    ("deepspeed", ["sh", "-c", "exec bash --login -c 'deepspeed train.py'"]),
]


@pytest.mark.parametrize(("launcher", "command"), LAUNCHERS)
def test_a_launcher_per_rank_is_refused_naming_per_node_mode_which_runs_it(
    launcher, command, tmp_path, azure_file, capsys
):
    common = ("--cluster", str(azure_file), "--workdir", str(task(tmp_path, "").parent / "code"), "--nodes", "2")
    code, _, err = checked(capsys, *common, "--dry-run", "--", *command)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: the command starts its own launcher ({launcher}): per rank, each would ")
    assert "run it once per node with --mode per-node" in lines[0], lines[0]
    # on one node: over two, a torchrun must also be told how the nodes join (below)
    code, out, err = checked(capsys, *common, "--nodes", "1", "--mode", "per-node", "--dry-run", "--", *command)
    assert code == 0, err
    assert "--ntasks-per-node=1" in out and "torchrun --nnodes" not in out  # the user's launcher, once per node


APART = [  # per node over 2 nodes, each torchrun would train a world of its own
    ("has no --nnodes", ["torchrun", "--nproc-per-node", "2", "train.py"]),
    ("has no --nnodes", ["python3", "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py"]),
    ("has no --nnodes", ["bash", "-c", "pip install -r r.txt\ntorchrun --nproc-per-node 2 train.py"]),
    ("neither --rdzv-endpoint nor --node-rank nor --master-addr", ["torchrun", "--nnodes", "2", "train.py"]),
    ("neither --rdzv-endpoint nor --master-addr", ["torchrun", "--nnodes=2", "--node_rank=$R", "train.py"]),
    # the script's own flags are not torchrun's
    (
        "neither --rdzv-endpoint nor --node-rank",
        ["torchrun", "--nnodes", "2", "--master-addr", "h", "t.py", "--node-rank", "1"],
    ),
    ("--nnodes 1 is fewer than the job's 2 nodes", ["torchrun", "--nnodes", "1", "--rdzv-endpoint", "h:1", "t.py"]),
    ("--standalone keeps each rendezvous on its own node", ["torchrun", "--standalone", "--nnodes", "2", "t.py"]),
]
JOINED = [
    ["torchrun", "--nnodes", "2", "--node-rank", "$R", "--master-addr", "$MASTER_ADDR", "train.py"],
    ["torchrun", "--nnodes=2", "--node_rank=1", "--master_addr=h", "train.py"],
    ["torchrun", "--nnodes", "1:2", "--rdzv-endpoint=h:29400", "train.py"],
    ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv_endpoint", "h:29400", "train.py"],
    ["bash", "-c", "PET_NNODES=2 torchrun --rdzv-backend c10d \\\n  --rdzv-endpoint h:1 train.py  # don't"],
    ["bash", "-c", "torchrun $TORCHRUN_ARGS train.py"],  # the shell's to expand
    ["accelerate", "launch", "train.py"],  # not torchrun's flags
]


@pytest.mark.parametrize(("why", "command"), APART)
def test_a_per_node_torchrun_that_would_not_join_the_nodes_into_one_world_is_refused(
    why, command, tmp_path, azure_file, capsys
):
    code_dir = str(task(tmp_path, "").parent / "code")
    common = ("--cluster", str(azure_file), "--workdir", code_dir, "--mode", "per-node", "--dry-run")
    code, _, err = checked(capsys, *common, "--nodes", "2", "--", *command)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: the command's ") and " runs once on each of 2 nodes, and " in lines[0]
    assert why in lines[0] and '--nnodes "$DTRAIN_NUM_NODES" --node-rank "$DTRAIN_NODE_RANK"' in lines[0], lines[0]
    code, _, err = checked(capsys, *common, "--nodes", "1", "--", *command)  # one node is one world
    assert code == 0, err


@pytest.mark.parametrize("command", JOINED, ids=str)
def test_a_per_node_torchrun_that_joins_the_nodes_runs(command, tmp_path, azure_file, capsys):
    code_dir = str(task(tmp_path, "").parent / "code")
    common = ("--cluster", str(azure_file), "--workdir", code_dir, "--mode", "per-node", "--dry-run")
    code, _, err = checked(capsys, *common, "--nodes", "2", "--", *command)
    assert code == 0, err


def test_a_task_file_torchrun_per_node_without_the_nodes_join_is_refused(tmp_path, azure_file, capsys, monkeypatch):
    text = (
        "workdir: code\nmode: per-node\nresources: {nodes: 2}\nrun: |\n  torchrun --nproc-per-node 2 \\\n    train.py\n"
    )
    code, _, err = checked(capsys, str(task(tmp_path, text)), "--cluster", str(azure_file), "--dry-run")
    assert code == 2 and err.startswith("error: the command's torchrun runs once on each of 2 nodes"), err
    # the example (its torchrun joins the nodes) runs as it is
    monkeypatch.setenv("HF_TOKEN", "hf-test")
    code, _, err = checked(capsys, str(EXAMPLE / "task.yaml"), "--cluster", str(azure_file), "--dry-run")
    assert code == 0, err


@pytest.mark.parametrize("command", [["horovodrun", "-np", "4", "python", "train.py"], ["mpirun", "python", "x.py"]])
def test_a_launcher_that_starts_every_rank_itself_is_refused_in_either_mode(command, tmp_path, azure_file, capsys):
    common = ("--cluster", str(azure_file), "--workdir", str(task(tmp_path, "").parent / "code"), "--dry-run")
    for mode in ("per-rank", "per-node"):
        code, _, err = checked(capsys, *common, "--mode", mode, "--", *command)
        assert code == 2 and "pass --launcher horovodrun" in err, err


def test_commands_that_are_not_launchers_run_per_rank():
    plain = (["python", "train.py"], ["python", "-m", "mypkg.train"], ["sh", "-c", "echo torchrun; python t.py"])
    assert [launcher_in(command) for command in plain] == [None, None, None]
    # each line of a script is a command of its own, comments left out, `\\`-newline continued
    assert launcher_in(["bash", "-c", "pip install x  # don't\ntorchrun \\\n t.py"]) == "torchrun"
    assert launcher_in(["bash", "-c", "echo 'a\ntorchrun' && python t.py"]) is None  # inside quotes


OPERATOR = b"DTRAIN_TEST_OPERATOR=1"  # in the environment of `launch` and its ssh: the operator's, not the job's


def _holders(secret: bytes, allowed: tuple[str, ...]) -> list[str]:
    """Processes whose argv holds the secret, or whose environment does and that are neither the
    operator's (who exported it) nor the user's own on the cluster (an allowed process or one it
    started: pip runs `rustc --version` for its user agent, say)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
        except OSError:
            continue
        words = cmdline.replace(b"\0", b" ").decode(errors="replace")
        if secret in cmdline or (
            secret in environ and OPERATOR not in environ and not _started_by(entry.name, allowed)
        ):
            found.append(f"{entry.name}: {words[:200]}")
    return found


def _started_by(pid: str, allowed: tuple[str, ...]) -> bool:
    """Whether the process or one of its ancestors runs one of the allowed commands."""
    while pid not in ("0", "1"):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # it ended between the reads: nothing to judge
            return True
        if any(word in words for word in allowed):
            return True
        pid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
    return False


def _files_holding(root: Path, secret: bytes) -> list[str]:
    """Files under root that hold the secret (logs, records, state: not the datasets other tests staged)."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 2**23 and secret in path.read_bytes():
                found.append(str(path))
        except OSError:
            continue
    return found


def test_a_task_file_runs_its_own_torchrun_on_each_node_as_one_model_and_keeps_its_secret(
    cluster, cluster_file, tmp_path
):
    workdir = tmp_path / "torchrun"
    shutil.copytree(EXAMPLE, workdir)
    secret = f"s3cr3t-{secrets.token_hex(8)}"
    env = {"HF_TOKEN": secret, OPERATOR.decode().split("=")[0]: "1"}
    # the user's processes only: the setup and the run, under their wrapper (`dtrain-env`)
    allowed = ("train.py", "torchrun", "setup.sh", "pip", "dtrain-env")
    seen, done = [], threading.Event()

    def watch() -> None:  # argv and environments, while the job runs
        while not done.wait(0.5):
            seen.extend(_holders(secret.encode(), allowed))
            secrets_file = run_dir(cluster, "task-1") / "secrets" / "env"
            if secrets_file.exists():
                seen.extend([] if secrets_file.stat().st_mode & 0o077 == 0 else [f"{secrets_file} is not 0600"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        first = launch(
            "--cluster", str(cluster_file), str(workdir / "task.yaml"), "--run-id", "task-1", "--follow", env=env
        )
    finally:
        done.set()
        watcher.join()
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert sorted(set(seen)) == []
    assert "[setup] node-0: running setup" in out and "[setup] node-1: running setup" in out
    # one world of 4 (2 nodes x torchrun --nproc-per-node 2): DDP made every rank's weights one model
    directory = run_dir(cluster, "task-1")
    metrics = json.loads((directory / "output" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["steps"] == 20  # envs: STEPS
    assert metrics["hf_token_sha256"] == hashlib.sha256(secret.encode()).hexdigest()  # the secret reached it
    replicas = [str(directory / "output" / f"replica-{rank}.pt") for rank in range(4)]
    compared = subprocess.run([TRAIN_PYTHON, "-c", SAME_WEIGHTS, *replicas], capture_output=True, text=True)
    assert compared.returncode == 0, compared.stderr[-2000:]
    # a second launch of the same task (a quicker command after --): setup is not run again
    again = launch(
        "--cluster",
        str(cluster_file),
        str(workdir / "task.yaml"),
        "--run-id",
        "task-2",
        "--follow",
        "--",
        "true",
        env=env,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "[setup] node-0: skipped, done before for this code and setup" in again.stdout + again.stderr
    assert "[setup] node-1: skipped" in again.stdout + again.stderr and "running setup" not in again.stdout
    # the secret is in no file: run directories, results, Slurm's logs and state, the cluster's state dir
    assert _files_holding(local_state_dir(cluster), secret.encode()) == []
    blobs = {**results_blobs(cluster, "task-1"), **results_blobs(cluster, "task-2")}
    assert [name for name, data in blobs.items() if secret.encode() in data] == []
    assert not (directory / "secrets").exists() and status_of(cluster, "task-1")["exit_code"] == 0
    assert _holders(secret.encode(), ()) == []


def test_a_failing_setup_fails_the_job_naming_setup(cluster, cluster_file, tmp_path):
    path = task(tmp_path, "workdir: code\nsetup: echo installing; exit 3\nrun: python train.py\n")
    proc = launch("--cluster", str(cluster_file), str(path), "--run-id", "task-setup-fails", "--follow")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "(run task-setup-fails): failed: setup failed on node-0 (exit status 3)" in out, out[-3000:]
    assert "hello" not in out  # the run never started


def test_a_secret_reaches_every_rank_under_horovodrun_and_nothing_else(cluster, cluster_file, tmp_path):
    """Per-rank mode under horovodrun, which copies its own environment onto its workers' ssh command
    lines: the secret is sourced by each rank, below horovodrun, so no command line holds it."""
    (tmp_path / "check.py").write_text(
        "import hashlib, os\nprint('token', hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest()[:12])\n"
    )
    secret = f"s3cr3t-{secrets.token_hex(8)}"
    env = {"HF_TOKEN": secret, OPERATOR.decode().split("=")[0]: "1"}
    flags = ("--workdir", str(tmp_path), "--launcher", "horovodrun", "--nodes", "2", "--secret", "HF_TOKEN")
    proc = launch(
        "--cluster", str(cluster_file), *flags, "--run-id", "task-hvd", "--follow", "--", "python", "check.py", env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count(f"token {hashlib.sha256(secret.encode()).hexdigest()[:12]}") == 2, out[-3000:]  # both ranks
    assert _files_holding(run_dir(cluster, "task-hvd"), secret.encode()) == []


# What the user's setup and run print: a one-line secret and a multi-line one (a PEM key), on stdout
# and stderr, and in the error line that becomes the job's verdict and `launch`'s last words.
PRINTS_SECRETS_SETUP = 'echo "setup sees $HF_TOKEN"\nprintf "%s\\n" "$PEM_KEY" >&2\n'
PRINTS_SECRETS_RUN = """
import os, sys
print("run sees", os.environ["HF_TOKEN"], flush=True)
print(os.environ["PEM_KEY"], file=sys.stderr, flush=True)
print("error: the server refused token", os.environ["HF_TOKEN"], flush=True)
sys.exit(3)
"""


def test_a_secret_printed_by_setup_and_run_is_masked_in_every_file_and_blob(cluster, cluster_file, tmp_path):
    token = f"s3cr3t-{secrets.token_hex(8)}"
    pem = f"-----BEGIN KEY-----\nkey-a-{secrets.token_hex(8)}\n  key-b-{secrets.token_hex(8)}\n-----END KEY-----"
    path = task(tmp_path, f"workdir: code\nsetup: {json.dumps(PRINTS_SECRETS_SETUP)}\nrun: python prints.py\n")
    (tmp_path / "code" / "prints.py").write_text(PRINTS_SECRETS_RUN)
    flags = ("--secret", "HF_TOKEN", "--secret", "PEM_KEY", "--nodes", "2", "--run-id", "task-masked", "--follow")
    proc = launch("--cluster", str(cluster_file), str(path), *flags, env={"HF_TOKEN": token, "PEM_KEY": pem})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "failed: the server refused token ***" in out, out[-3000:]  # the verdict, masked
    directory = run_dir(cluster, "task-masked")
    log = (directory / "output.log").read_text()
    assert "setup sees ***" in log and "run sees ***" in log
    assert "run sees ***" in (directory / "logs" / "rank-0.log").read_text()
    # the whole values and each line of the key: in no file on the share nor blob, nor what launch printed
    blobs = results_blobs(cluster, "task-masked")
    assert "task-masked/output.log" in blobs and "task-masked/status.json" in blobs
    for piece in [token, pem, *(line.strip() for line in pem.splitlines())]:
        assert _files_holding(directory, piece.encode()) == [], piece
        assert [name for name, data in blobs.items() if piece.encode() in data] == [], piece
        assert piece not in out, piece


def test_setup_runs_once_per_code_and_setup_as_the_clusters_non_root_user():
    """setup_once.py as Azure runs it: as the admin user, not root, with its markers on a 1777 disk."""
    tool = REPO / "dtrain" / "remote" / "job" / "setup_once.py"
    root = Path(tempfile.mkdtemp(prefix="dtrain-setup-", dir="/tmp"))
    try:
        root.chmod(0o755)
        (root / "code").mkdir()
        (root / "code" / "train.py").write_text("print('v1')\n")
        (root / "setup.sh").write_text("echo setup\n")
        for shared in ("cache", "out"):
            (root / shared).mkdir(mode=0o1777)
            (root / shared).chmod(0o1777)

        def setup(cache: str = "cache") -> str:
            argv = [str(tool), "--code", str(root / "code"), "--setup", str(root / "setup.sh"), "--cache-dir"]
            argv += [str(root / cache), "--", "sh", "-c", f"echo ran >>{root}/out/log"]
            proc = subprocess.run(["runuser", "-u", "nobody", "--", "python3", *argv], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc.stdout

        assert "running setup" in setup() and "skipped, done before" in setup()
        assert list((root / "cache").glob("*/nobody/*/done"))  # the marker: per host, per user, per key
        (root / "code" / "train.py").write_text("print('v2')\n")  # new code: setup again
        assert "running setup" in setup()
        assert "setup runs every time" in setup(cache="code/cannot")  # a cache it cannot make: no skipping
        assert (root / "out" / "log").read_text() == "ran\n" * 3
    finally:
        shutil.rmtree(root)
