"""A SkyPilot task file under `launch`: its keys mapped to the launch's options and checked against the cluster
(dtrain/jobs/skypilot_keys.py, dtrain/jobs/cluster_fit.py), the keys this cluster cannot honour refused one
line each, and SkyPilot's variables on every node in setup and run (dtrain/jobs/task_steps.py). Three task
files modelled on SkyPilot's own examples (fixtures/skypilot/) run on the local cluster as written, or are
refused naming the one key it cannot honour; the mapping and the refusals are checked without a cluster."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from . import test_task_file
from .conftest import FIXTURES, SESSION_SUBNET, address
from .test_launcher import cli, run_dir, status_of
from .test_task_file import checked, task

azure_file = test_task_file.azure_file  # an Azure cluster's description (a fixture): for --dry-run
SKYPILOT = FIXTURES / "skypilot"
CODE = "workdir: code\nrun: python train.py\n"  # a task's least; the keys under test follow


def dry_run(capsys: pytest.CaptureFixture, cluster: Path, path: Path, *flags: str) -> tuple[int, str, str]:
    return checked(capsys, "--cluster", str(cluster), str(path), *flags, "--dry-run")


def refusal(capsys: pytest.CaptureFixture, cluster: Path, path: Path) -> str:
    """The one error line of a task that is refused before anything is planned (exit 2, no batch script)."""
    code, out, err = dry_run(capsys, cluster, path)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    return lines[0]


# resources.accelerators in SkyPilot's forms -> the GPUs per node the job asks for (Azure: 8 H100 a node)
ACCELERATORS = {
    "H100:8": 8,
    "h100:2": 2,  # any case
    "H100": 1,  # a name alone: one
    "{H100: 4}": 4,
    "[A100:8, H100:2]": 2,  # a list, tried in order: the first the nodes have
    "{A100-80GB:8, H100:4}": 4,  # a set, YAML's keys without values
    "[H100:16, H100:8]": 8,  # the first that fits on a node
}


@pytest.mark.parametrize("form", ACCELERATORS)
def test_accelerators_in_each_of_skypilots_forms_ask_for_that_many_gpus_a_node(form, tmp_path, azure_file, capsys):
    code, out, err = dry_run(capsys, azure_file, task(tmp_path, f"{CODE}resources:\n  accelerators: {form}\n"))
    assert code == 0, err
    assert f"#SBATCH --gres=gpu:{ACCELERATORS[form]}\n" in out and f"{ACCELERATORS[form]} of 8 GPUs" in err
    # the flag wins over the file's count; the name is still the nodes'
    code, out, err = dry_run(
        capsys, azure_file, task(tmp_path, f"{CODE}resources:\n  accelerators: {form}\n"), "--gpus-per-node", "3"
    )
    assert code == 0 and "#SBATCH --gres=gpu:3\n" in out, err


# What a task asks of the nodes that they do not have, or a key SkyPilot has and this cluster cannot honour:
# refused naming its key, before anything is planned
REFUSED = {
    "resources:\n  accelerators: A100:8\n": "resources.accelerators: A100:8, and the nodes of cluster dev have 8 H100",
    "resources:\n  accelerators: H100:16\n": "resources.accelerators: H100:16 asks for 16 GPUs on a node, and a node",
    "resources:\n  accelerators: T4:0.5\n": "resources.accelerators: T4:0.5: a fraction of a GPU",
    "resources:\n  cpus: 128+\n": "resources.cpus: 128, and a node of cluster dev has 96 vCPUs",
    "resources:\n  memory: 4TB\n": "resources.memory: 4096 GB, and a node of cluster dev has 1900 GB",
    "resources:\n  disk_size: 1024\n": "resources.disk_size: 1024 GB, and a node's OS disk is 256 GB",
    "resources:\n  instance_type: p4d.24xlarge\n": "resources.instance_type: p4d.24xlarge, and the nodes of cluster",
    "resources:\n  image_id: ami-0868a20f5a3bf9702\n": "resources.image_id: 'ami-0868a20f5a3bf9702' names a machine",
    "resources:\n  infra: aws/us-east-1\n": "resources.infra: aws: another cloud; this cluster is on Azure",
    "resources:\n  cloud: gcp\n": "resources.cloud: gcp: another cloud",
    "resources:\n  region: westus2\n": "resources.region: westus2, and cluster dev is in eastus",
    "resources:\n  infra: azure/eastus/1\n": "resources.infra: azure/eastus/1: an availability zone",
    "resources:\n  zone: eastus-1\n": "resources.zone: an availability zone",
    "resources:\n  ports: 8080\n": "resources.ports: opens ports to the Internet",
    "resources:\n  autostop: 10m\n": "resources.autostop: the stack's power saving deallocates idle nodes",
    "resources:\n  any_of:\n    - infra: aws\n": "resources.any_of: candidate resources across clouds or regions",
    "resources:\n  disk_tier: best\n": "resources.disk_tier: the nodes' disks are the stack's",
    "resources:\n  accelerators: H100:8\n  gpus: 8\n": "resources: gpus and accelerators say the same thing",
    "num_nodes: 2\nresources:\n  nodes: 2\n": "num_nodes and resources.nodes say the same thing: keep one",
    "service:\n  readiness_probe: /\n": "service: SkyServe",
    "config:\n  kubernetes: {}\n": "config: SkyPilot's own settings",
    "workdir2: x\n": "workdir2: Extra inputs are not permitted",  # unknown keys stay refused
    "file_mounts:\n  /data: ~/data\n": "file_mounts: /data: ~/data copies files from this machine",
    "file_mounts:\n  /data: s3://bucket/x\n": "file_mounts: /data: s3://bucket/x is another cloud's storage",
    "file_mounts:\n  /data: {name: my-bucket, store: azure}\n": "file_mounts: /data: names or creates a bucket",
    "file_mounts:\n  /shared/data/x: https://other.blob.core.windows.net/data/x\n": "is not a dataset in cluster",
    "file_mounts:\n  /data: https://hvddevst3f9a1c.blob.core.windows.net/data/imagenet\n": (
        "file_mounts: /data: the nodes see https://hvddevst3f9a1c.blob.core.windows.net/data/imagenet at "
        "/shared/data/imagenet"
    ),
    "envs: {MODEL: null}\n": "envs.MODEL: required (empty in the file): pass --env MODEL=VALUE",
    "envs: {SKYPILOT_NODE_RANK: 1}\n": "SKYPILOT_NODE_RANK: the job sets this variable itself",
}


@pytest.mark.parametrize("text", REFUSED, ids=lambda text: text.replace("\n", " ")[:50])
def test_what_the_cluster_cannot_do_is_refused_in_one_line_naming_the_key(text, tmp_path, azure_file, capsys):
    line = refusal(capsys, azure_file, task(tmp_path, CODE + text))
    assert line.startswith("error: ") and REFUSED[text] in line, line


def test_what_the_nodes_have_is_honoured_and_mapped_to_the_launchs_options(tmp_path, azure_file, capsys, monkeypatch):
    dataset = "https://hvddevst3f9a1c.blob.core.windows.net/data/imagenet"
    text = (
        f"{CODE}num_nodes: 2\nenvs: {{HF_TOKEN: null}}\nfile_mounts:\n  /shared/data/imagenet: {dataset}\n"
        "resources:\n  accelerators: H100:8\n  cpus: 96\n  memory: 1024GB+\n  disk_size: 256GB\n"
        "  instance_type: standard_nd96isr_h100_v5\n  infra: azure/eastus\n  network_tier: best\n"
        "  image_id: docker:nvcr.io/nvidia/pytorch:25.01-py3\n"
    )
    monkeypatch.delenv("HF_TOKEN", raising=False)
    path = task(tmp_path, text)
    assert refusal(capsys, azure_file, path).startswith("error: secret HF_TOKEN: not set in this environment")
    monkeypatch.setenv("HF_TOKEN", "hf-not-written-down")  # an empty credential env: a secret, read at launch
    code, out, err = dry_run(capsys, azure_file, path)
    assert code == 0, err
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --gres=gpu:8\n" in out and "/secrets/env" in out
    assert " nvcr.io/nvidia/pytorch:25.01-py3 sh -c " in out and "hf-not-written-down" not in out + err
    assert "--ntasks-per-node=1" in out  # SkyPilot's run: once per node (per-node mode)
    spot = task(tmp_path, f"{CODE}resources:\n  use_spot: true\n")
    assert "--spot: the cluster has no Spot partition" in refusal(capsys, azure_file, spot)  # as resources.spot


def test_skypilots_variables_are_set_on_every_node_in_setup_and_run(tmp_path, azure_file, capsys):
    """The job's values once in the batch shell, the node's rank by the command's own wrapper, in each runtime;
    a file in our own keys alone runs per rank, as before."""
    text = f"{CODE}setup: echo ready\nnum_nodes: 2\nresources:\n  accelerators: H100:4\n"
    code, out, err = dry_run(capsys, azure_file, task(tmp_path, text), "--run-id", "sky-1")
    assert code == 0, err
    (exports,) = [line for line in out.splitlines() if line.startswith("export DTRAIN_NUM_NODES=")]
    for pair in ("SKYPILOT_NUM_NODES=2", "SKYPILOT_NUM_GPUS_PER_NODE=4", "SKYPILOT_TASK_ID=sky-1"):
        assert pair in exports, exports
    info = json.loads(re.search(r"SKYPILOT_CLUSTER_INFO='([^']*)'", exports).group(1))
    assert info == {"cluster_name": "dev", "cloud": "Azure", "region": "eastus", "zone": None}
    assert 'export SKYPILOT_NODE_IPS SKYPILOT_SETUP_NODE_IPS="$SKYPILOT_NODE_IPS"' in out
    rank = 'DTRAIN_NODE_RANK="$SLURM_NODEID" SKYPILOT_NODE_RANK="$SLURM_NODEID" SKYPILOT_SETUP_NODE_RANK='
    setup, run = (next(line for line in out.splitlines() if marker in line) for marker in ("setup_once", "train.py"))
    assert rank in setup and rank in run and "-e SKYPILOT_NODE_IPS" in run  # the containers get them too
    assert out.index(exports) < out.index(setup)
    code, out, err = dry_run(capsys, azure_file, task(tmp_path, CODE))  # ours: per rank, none of SkyPilot's
    assert code == 0 and "SKYPILOT_" not in out and "torchrun --nnodes 1 --nproc-per-node 8" in out, err
    code, out, err = dry_run(capsys, azure_file, task(tmp_path, CODE + "setup: echo ready\n"))
    assert code == 0 and "SKYPILOT_NODE_RANK=" in out, err  # setup has them; the ranks after it do not
    lines = out.splitlines()
    unset = next(i for i, line in enumerate(lines) if line.startswith("unset DTRAIN_NUM_NODES"))
    assert "setup_once.py" in lines[unset - 1] and "SKYPILOT_CLUSTER_INFO" in lines[unset]
    assert unset < next(i for i, line in enumerate(lines) if "torchrun --nnodes" in line)


def test_the_skypilot_examples_plan_on_azure_or_name_the_key_they_cannot_have(azure_file, capsys):
    for name in ("setup_heavy", "multinode"):
        code, _, err = dry_run(capsys, azure_file, SKYPILOT / f"{name}.yaml")
        assert code == 0, err
    line = refusal(capsys, azure_file, SKYPILOT / "ddp_benchmark.yaml")
    assert line.startswith(f"error: {SKYPILOT / 'ddp_benchmark.yaml'}: resources.cloud: gcp: another cloud"), line


def test_skypilot_examples_run_on_the_local_cluster_as_written(cluster, cluster_file, tmp_path):
    """A multi-node torchrun whose head node is `head -n1` of SKYPILOT_NODE_IPS, and a setup-heavy single-node
    task, run unchanged; the benchmark that names GCP is refused at resources.cloud, nothing submitted."""
    workdir = tmp_path / "skypilot"
    shutil.copytree(SKYPILOT, workdir)
    launch = ("launch", "--cluster", str(cluster_file), "--follow")
    multi = cli(*launch, str(workdir / "multinode.yaml"), "--run-id", "sky-multi")
    out = multi.stdout + multi.stderr
    assert multi.returncode == 0 and "your command once per node on 2 nodes" in out, out[-4000:]
    ips = [address(SESSION_SUBNET, 10), address(SESSION_SUBNET, 11)]  # node-0's, node-1's (dtrain/local/cluster.py)
    result = json.loads((run_dir(cluster, "sky-multi") / "output" / "report.json").read_text())
    assert (result["world_size"], result["rank_sum"]) == (2, 0 + 1)  # one world across both nodes
    assert sorted(view["SKYPILOT_NODE_RANK"] for view in result["ranks"]) == ["0", "1"]
    for view in result["ranks"]:
        assert view["SKYPILOT_NODE_IPS"] == "\n".join(ips) and view["MASTER_ADDR"] == ips[0], view
        assert (view["SKYPILOT_NUM_NODES"], view["SKYPILOT_NUM_GPUS_PER_NODE"]) == ("2", "0")  # CPU nodes
        assert view["SKYPILOT_TASK_ID"] == "sky-multi"
    assert f"node 1 of 2, head node {ips[0]}" in out and status_of(cluster, "sky-multi")["exit_code"] == 0

    single = cli(*launch, str(workdir / "setup_heavy.yaml"), "--run-id", "sky-setup")
    out = single.stdout + single.stderr
    assert single.returncode == 0, out[-4000:]
    assert f"setup on node 0 of 1: ips {ips[0]}" in out and "setup found torch" in out
    assert "training tiny-linear for 2 epochs on node 0" in out
    assert json.loads((run_dir(cluster, "sky-setup") / "output" / "report.json").read_text())["model"] == "tiny-linear"

    refused = cli(*launch, str(workdir / "ddp_benchmark.yaml"), "--run-id", "sky-gcp")
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "resources.cloud: gcp: another cloud; this cluster is on Azure (or the local emulation of it)"
    ), refused.stderr
    # a staged dataset mounted where the nodes see it: checked for on the share as the job is submitted
    mount = f"file_mounts:\n  {cluster.data_path}/never-staged: {cluster.data.url}/never-staged\n"
    (workdir / "mounts.yaml").write_text((workdir / "setup_heavy.yaml").read_text() + mount)
    unstaged = cli(*launch, str(workdir / "mounts.yaml"), "--run-id", "sky-mount")
    assert unstaged.returncode == 2 and unstaged.stderr.strip().endswith(
        f"error: file_mounts: {cluster.data_path}/never-staged: not all on the shared file system: stage each "
        "dataset first (dtrain stage all DIR --dataset NAME)"
    ), unstaged.stderr
    assert not run_dir(cluster, "sky-gcp").exists() and not run_dir(cluster, "sky-mount").exists()
