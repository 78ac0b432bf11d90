"""Stack outputs -> cluster description, from a recorded `pulumi stack output --json` (no cluster needed)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from infra.contract import StackOutput
from scripts import cluster as cl
from scripts import launch
from scripts.cluster import ClusterDescription, NodeRecord
from scripts.errors import OperatorError

from .conftest import FIXTURES, private_key_file, run_module

OUTPUTS = json.loads((FIXTURES / "stack_outputs.json").read_text())
FAKE_PULUMI_PATH = f"{FIXTURES / 'bin'}{os.pathsep}{os.environ['PATH']}"


def test_outputs_map_to_the_description(tmp_path):
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="/keys/id_ed25519", known_hosts=tmp_path / "kh")
    assert desc.provider == "azure" and desc.name == "dev"
    assert (desc.jump_host.host, desc.jump_host.user, desc.jump_host.port) == ("20.51.100.7", "azureuser", 22)
    assert (desc.storage_host.host, desc.storage_host.user) == ("10.20.2.4", "azureuser")
    assert desc.ssh_user == "azureuser" and desc.ssh_key == "/keys/id_ed25519"
    assert (desc.node_count, desc.gpus_per_node, desc.gpu_sku) == (2, 8, "Standard_ND96isr_H100_v5")
    assert desc.expect_infiniband and desc.shared_is_mount
    assert desc.shared_mount_path == "/shared" and desc.node_registry_path == "/shared/nodes"
    assert desc.data_path == "/shared/data" and desc.storage_export_path == "/export"
    # the NFS server sees the nodes' /shared as /export
    assert desc.on_storage_host(desc.node_registry_path) == "/export/nodes"
    assert desc.on_storage_host("/shared/data/imagenet") == "/export/data/imagenet"
    assert desc.data.url == "https://hvddevst3f9a1c.blob.core.windows.net/data"
    assert desc.data.credential.kind == "sas"
    assert desc.data.credential.secret.get_secret_value() == OUTPUTS["data_sas"]
    assert desc.results.url.endswith("/results") and desc.results.credential.kind == "entra_id"
    assert desc.staging_credential.kind == "entra_id"
    assert desc.nccl_env == OUTPUTS["nccl_env"]
    assert "NCCL_IB_DISABLE" not in desc.nccl_env
    assert desc.runtime.kind == "docker" and desc.runtime.ssh_port == cl.CONTAINER_SSH_PORT
    assert desc.runtime.images["pytorch"] == "hvddevacr3f9a1c.azurecr.io/hvd-pytorch:latest"
    assert desc.runtime.images["keras"] == "hvddevacr3f9a1c.azurecr.io/hvd-tensorflow:latest"
    assert desc.blob_pull[-1] == "blob-pull"
    # Slurm's commands run on the head node, through the jump host, with its own /etc/slurm/slurm.conf
    assert desc.slurm.model_dump() == {
        "cluster_name": "hvd-dev",
        "partition": "gpu",
        "controller_host": "hvd-dev-head",
        "controller_address": "10.20.1.4",
        "login": {"host": "10.20.1.4", "user": "azureuser", "port": 22},
        "conf": None,
    }


def test_image_tag_and_host_runtime():
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k", image_tag="0123456789ab")
    assert desc.runtime.images["tensorflow"].endswith("/hvd-tensorflow:0123456789ab")
    host = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k", runtime="host")
    assert host.runtime.kind == "host" and host.runtime.ssh_port is None


def test_missing_outputs_are_named():
    partial = {k: v for k, v in OUTPUTS.items() if k not in ("data_sas", "jumpbox_public_ip")}
    with pytest.raises(OperatorError, match=r"missing outputs: jumpbox_public_ip, data_sas"):
        cl.from_stack_outputs(partial, "dev", ssh_key="k")


def test_saved_description_is_private_and_reloads_with_secrets(tmp_path):
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k")
    path = desc.save(tmp_path / "cluster.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = cl.load(path)
    assert again.data.credential.secret.get_secret_value() == OUTPUTS["data_sas"]
    assert again == desc
    shown = json.dumps(desc.masked())
    assert OUTPUTS["data_sas"] not in shown and "***" in shown


def test_pulumi_boundary_known_stack(monkeypatch):
    monkeypatch.setenv("PATH", FAKE_PULUMI_PATH)
    desc = cl.from_pulumi_stack("dev", ssh_key="k")
    assert isinstance(desc, ClusterDescription) and desc.storage_host.host == "10.20.2.4"


def test_pulumi_boundary_unknown_stack(monkeypatch):
    monkeypatch.setenv("PATH", FAKE_PULUMI_PATH)
    with pytest.raises(OperatorError, match=r"cannot read outputs of stack 'nope': error: no stack named 'nope' found"):
        cl.from_pulumi_stack("nope", ssh_key="k")


def test_pulumi_cli_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(OperatorError, match="pulumi is not installed or not on PATH") as err:
        cl.pulumi_stack_outputs("dev")
    assert err.value.exit_code == 3


def test_cli_from_stack_writes_the_description(tmp_path):
    out = tmp_path / "c.json"
    key = private_key_file(tmp_path)
    proc = run_module(
        "scripts.cluster", "from-stack", "--stack", "dev", "--ssh-key", str(key), "-o", str(out),
        env={"PATH": FAKE_PULUMI_PATH},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert cl.load(out).jump_host.host == "20.51.100.7" and cl.load(out).ssh_key == str(key)
    shown = run_module("scripts.cluster", "show", "--cluster", str(out))
    assert shown.returncode == 0 and OUTPUTS["data_sas"] not in shown.stdout and "20.51.100.7" in shown.stdout


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        ("nope", "error: cannot read outputs of stack 'nope': error: no stack named 'nope' found"),
        ("half", "error: stack 'half' is missing outputs: nfs_private_ip, data_sas, nccl_env"),
    ],
)
def test_cli_from_stack_faults(tmp_path, stack, expected):
    proc = run_module(
        "scripts.cluster", "from-stack", "--stack", stack, "-o", str(tmp_path / "c.json"),
        "--ssh-key", str(private_key_file(tmp_path)), env={"PATH": FAKE_PULUMI_PATH}, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert not (tmp_path / "c.json").exists()


def test_docker_runtime_commands():
    """The Azure path cannot run here: check the commands it would run on the nodes."""
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k")
    run_dir = "/shared/runs/r1"
    start = launch.docker_run_command(desc, "r1", run_dir, desc.runtime.images["pytorch"], gpus=True)
    for flag in (
        "--network host", "--ipc host", "--gpus all", "--device /dev/infiniband", "--ulimit memlock=-1",
        "-v /shared:/shared", "-e HVD_RUN_ID=r1", "-e NCCL_SOCKET_IFNAME=eth0", "--name hvd-r1",
        "hvddevacr3f9a1c.azurecr.io/hvd-pytorch:latest",
    ):  # fmt: skip
        assert flag in start
    assert "-p 12345" in start and "hvd_run_key" in start
    opts = launch.LaunchOptions(framework="pytorch", job_args=["--model", "resnet50"])
    cmd = launch.horovodrun_command(desc, opts, "r1", run_dir, 16, f"{run_dir}/metrics.json")
    assert cmd.startswith("docker exec -e HVD_RUN_ID=r1 hvd-r1 sh -c ")
    for part in ("horovodrun --gloo -np 16", "--hostfile /shared/runs/r1/hostfile", "-p 12345",
                 "python -m training.pytorch --model resnet50 --metrics-json /shared/runs/r1/metrics.json",
                 "NCCL_TOPO_FILE=/opt/microsoft/ndv5-topo.xml", "cd /workspace"):  # fmt: skip
        assert part in cmd
    assert launch.sweep_command(desc, "r1").startswith("if docker rm -f hvd-r1")
    nodes = [
        NodeRecord(
            hostname="vmss000000", address="10.20.1.4", gpus=8, ib_state="ACTIVE", ready_at="2026-01-01T00:00:00Z"
        ),
        NodeRecord(
            hostname="vmss000001", address="10.20.1.5", gpus=8, ib_state="ACTIVE", ready_at="2026-01-01T00:00:00Z"
        ),
    ]
    assert launch.hostfile_text(nodes, 8) == "10.20.1.4 slots=8\n10.20.1.5 slots=8\n"
    assert launch.rank_hosts(nodes, 2) == ["vmss000000", "vmss000000", "vmss000001", "vmss000001"]
    files = launch.ssh_files_for_horovodrun(desc, nodes, run_dir, run_key="KEY")
    assert "Port 12345" in files["ssh/config"][0] and "/root/.ssh/hvd_run_key" in files["ssh/config"][0]
    assert files["ssh/id_ed25519"] == ("KEY", 0o600)  # a private key on the share is never world-readable


def test_every_output_the_cli_reads_is_one_the_stack_declares():
    # infra/contract.py names the stack's outputs; the CLI must not read one the stack never exports.
    assert cl.REQUIRED_OUTPUTS and set(cl.REQUIRED_OUTPUTS) <= set(StackOutput)
