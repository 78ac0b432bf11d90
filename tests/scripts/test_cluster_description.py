"""Stack outputs -> cluster description, from a recorded `pulumi stack output --json` (no cluster needed)."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
from pydantic import SecretStr, ValidationError

from dtrain.cluster import description as cl
from dtrain.cluster.description import BlobCredential, ClusterDescription
from dtrain.cluster.ssh import SSH
from dtrain.errors import OperatorError
from infra.contract import StackOutput

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
    assert desc.region == "eastus"  # with the SKU, what prices a run
    assert desc.expect_infiniband and desc.shared_is_mount
    assert desc.shared_mount_path == "/shared"
    assert desc.data_path == "/shared/data" and desc.storage_export_path == "/export"
    assert desc.local_data_path == "/nvme/data"
    # the NFS server sees the nodes' /shared as /export
    assert desc.on_storage_host("/shared/runs") == "/export/runs"
    assert desc.on_storage_host("/shared/data/imagenet") == "/export/data/imagenet"
    assert desc.data.url == "https://hvddevst3f9a1c.blob.core.windows.net/data"
    assert desc.data.credential.kind == "sas"
    assert desc.data.credential.secret.get_secret_value() == OUTPUTS["data_sas"]
    assert desc.results.url.endswith("/results") and desc.results.credential.kind == "entra_id"
    assert desc.staging_credential.kind == "entra_id"
    # jobs write their results from the nodes with the cluster's identity: no secret reaches the cluster
    assert desc.results_upload == BlobCredential(
        kind="managed_identity", client_id=OUTPUTS["cluster_identity_client_id"]
    )
    assert desc.remote_python == "python3" and desc.schema_version == 2
    # the stack's defaultJobTime and maxJobTime
    assert (desc.default_time_limit, desc.max_time_limit) == ("24:00:00", "7-00:00:00")
    assert desc.nccl_env == OUTPUTS["nccl_env"]
    assert "NCCL_IB_DISABLE" not in desc.nccl_env
    assert desc.runtime.kind == "docker" and desc.runtime.ssh_port == cl.CONTAINER_SSH_PORT
    assert desc.runtime.images["pytorch"] == "hvddevacr3f9a1c.azurecr.io/hvd-pytorch:latest"
    assert desc.runtime.images["keras"] == "hvddevacr3f9a1c.azurecr.io/hvd-tensorflow:latest"
    assert desc.blob_pull == ["sudo", "-n", "blob-pull"]
    # Slurm's commands run on the head node, through the jump host, with its own /etc/slurm/slurm.conf
    assert desc.slurm.model_dump() == {
        "cluster_name": "hvd-dev",
        "partition": "gpu",
        "spot_partition": None,  # the stack has no Spot nodes
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


def test_job_time_limits_come_from_the_stack_and_default_time_overrides_within_the_max():
    configured = cl.from_stack_outputs({**OUTPUTS, "default_job_time": "4:00:00"}, "dev", ssh_key="k")
    assert (configured.default_time_limit, configured.max_time_limit) == ("4:00:00", "7-00:00:00")
    chosen = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k", default_time_limit="7-00:00:00")
    assert (chosen.default_time_limit, chosen.max_time_limit) == ("7-00:00:00", "7-00:00:00")
    with pytest.raises(OperatorError, match=r"--default-time 7-00:00:01 is longer than the maxJobTime of stack 'dev'"):
        cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k", default_time_limit="7-00:00:01")
    # a stack deployed before the limits were outputs: its slurm.conf has the defaults, a day and no cap
    older = {key: value for key, value in OUTPUTS.items() if key not in ("default_job_time", "max_job_time")}
    desc = cl.from_stack_outputs(older, "dev", ssh_key="k", default_time_limit="30-00:00:00")
    assert (desc.default_time_limit, desc.max_time_limit) == ("30-00:00:00", "INFINITE")


def test_description_without_time_limits_loads_and_one_above_its_max_is_refused(tmp_path):
    saved = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k").model_dump(mode="json", context={"reveal_secrets": True})
    older = {key: value for key, value in saved.items() if key not in ("default_time_limit", "max_time_limit")}
    (tmp_path / "old.json").write_text(json.dumps(older))
    desc = cl.load(tmp_path / "old.json")
    assert (desc.default_time_limit, desc.max_time_limit) == ("24:00:00", "INFINITE")
    (tmp_path / "unlimited.json").write_text(json.dumps({**saved, "max_time_limit": "unlimited"}))
    assert cl.load(tmp_path / "unlimited.json").max_time_limit == "INFINITE"
    (tmp_path / "bad.json").write_text(json.dumps({**saved, "default_time_limit": "8-00:00:00"}))
    with pytest.raises(OperatorError, match=r"default_time_limit 8-00:00:00 is longer than max_time_limit 7-00:00:00"):
        cl.load(tmp_path / "bad.json")


def test_alloc_refuses_a_time_above_the_clusters_max_as_launch_does(tmp_path):
    """The description alone decides: no connection is tried (its jump host is not reachable). Launch's
    refusal is among test_cli_errors' cases."""
    path = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key=private_key_file(tmp_path)).save(tmp_path / "c.json")
    proc = run_module("dtrain", "alloc", "--cluster", str(path), "--time", "10081", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: --time 10081 is longer than cluster dev allows, 7-00:00:00 (maxJobTime in its stack's config, "
        "the partitions' MaxTime): ask for less"
    )


def test_dry_run_shows_the_time_limit_in_effect_and_the_clusters_max(tmp_path):
    path = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key=private_key_file(tmp_path)).save(tmp_path / "c.json")
    launch = ["launch", "--cluster", str(path), "--framework", "pytorch", "--gpus", "2", "--dry-run"]
    default = run_module("dtrain", *launch, timeout=60)
    asked = run_module("dtrain", *launch, "--time", "7-00:00:00", timeout=60)
    assert default.returncode == asked.returncode == 0, default.stderr + asked.stderr
    assert "time limit 24:00:00 (at most 7-00:00:00 on this cluster)" in default.stderr
    assert "#SBATCH --time=24:00:00\n" in default.stdout
    assert "time limit 7-00:00:00 (at most 7-00:00:00 on this cluster)" in asked.stderr
    assert "#SBATCH --time=7-00:00:00\n" in asked.stdout
    # the most it may cost is the hourly price over the limit: 2 of 8 GPUs of a $98.32 node for 7 days
    assert "estimated cost: $24.58/hour, at most $4,129.44 within the time limit" in asked.stderr


def test_a_lustre_stack_stages_through_its_head_node_where_the_nodes_mount_it(tmp_path):
    """No NFS server: the head node, which mounts Lustre at /shared as the nodes do, runs blob-pull."""
    lustre = {**OUTPUTS, "shared_storage": "lustre", "nfs_private_ip": None, "nfs_export_path": None}
    key = private_key_file(tmp_path)
    desc = cl.from_stack_outputs({**lustre, "lustre_mgs_address": "10.20.3.5"}, "dev", ssh_key=key)
    assert (desc.shared_storage, desc.storage_host.host, desc.storage_export_path) == ("lustre", "10.20.1.4", "/shared")
    assert desc.on_storage_host("/shared/data/imagenet") == "/shared/data/imagenet"
    assert SSH(desc).storage.label == "head node (Lustre) azureuser@10.20.1.4:22"
    # imported at the file system's root: the stack says the datasets are there
    assert cl.from_stack_outputs({**lustre, "data_path": "/shared"}, "dev", ssh_key="k").data_path == "/shared"
    # an NFS stack without its server's address is refused, naming what is missing
    with pytest.raises(OperatorError, match="missing outputs: nfs_private_ip "):
        cl.from_stack_outputs({**OUTPUTS, "nfs_private_ip": None}, "dev", ssh_key="k")
    before = {key: value for key, value in OUTPUTS.items() if key not in ("shared_storage", "lustre_mgs_address")}
    assert cl.from_stack_outputs(before, "dev", ssh_key="k").shared_storage == "nfs"  # a stack from before Lustre


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
        "dtrain", "cluster", "from-stack", "--stack", "dev", "--ssh-key", str(key), "-o", str(out),
        env={"PATH": FAKE_PULUMI_PATH},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert cl.load(out).jump_host.host == "20.51.100.7" and cl.load(out).ssh_key == str(key)
    shown = run_module("dtrain", "cluster", "show", "--cluster", str(out))
    assert shown.returncode == 0 and OUTPUTS["data_sas"] not in shown.stdout and "20.51.100.7" in shown.stdout


def test_cli_show_prints_one_field_for_a_command_line(tmp_path):
    """`cluster show --field data_path` is what the docs put in a job's --data-dir: the bare value (a dotted
    name reaches inside an object, which prints as JSON, secrets still masked); a name the description
    does not have is a usage error that lists the ones it has."""
    out = tmp_path / "c.json"
    cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="/keys/id_ed25519", known_hosts=tmp_path / "kh").save(out)

    def show(field: str) -> subprocess.CompletedProcess:
        return run_module("dtrain", "cluster", "show", "--field", field, env={"CLUSTER_DESCRIPTION": str(out)})

    assert show("data_path").stdout == "/shared/data\n"
    assert show("slurm.partition").stdout == "gpu\n"
    credential = show("data.credential")
    assert json.loads(credential.stdout)["kind"] == "sas" and OUTPUTS["data_sas"] not in credential.stdout
    for field, message in [
        ("data_pth", "--field data_pth: the description has no 'data_pth' (its fields: schema_version, name,"),
        ("data_path.x", '--field data_path.x: data_path is "/shared/data", which has no fields'),
        ("slurm.queue", "--field slurm.queue: slurm has no 'queue' (its fields: cluster_name,"),
    ]:
        refused = show(field)
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert refused.stderr.startswith(f"error: {message}") and len(refused.stderr.splitlines()) == 1


def test_cli_from_stack_writes_outside_the_repository_by_default(tmp_path):
    """The description holds the data SAS: by default it goes to the user's config directory (0700,
    file 0600), and an -o inside the repository is refused before pulumi is even asked."""
    key = private_key_file(tmp_path)
    env = {"PATH": FAKE_PULUMI_PATH, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = run_module("dtrain", "cluster", "from-stack", "--stack", "dev", "--ssh-key", str(key), env=env)
    assert proc.returncode == 0, proc.stderr
    written = tmp_path / "config" / "azure-horovod" / "cluster-dev.json"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and stat.S_IMODE(written.parent.stat().st_mode) == 0o700
    assert f"export CLUSTER_DESCRIPTION={written}" in proc.stdout
    assert not list(cl.REPO_ROOT.glob("cluster-*.json"))
    inside = cl.REPO_ROOT / "cluster-dev.json"
    refused = run_module("dtrain", "cluster", "from-stack", "--stack", "dev", "--ssh-key", str(key), "-o", str(inside))
    assert refused.returncode == 2 and not inside.exists()
    assert (
        refused.stderr.startswith(f"error: --output {inside} is inside the repository")
        and len(refused.stderr.splitlines()) == 1
    )


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        ("nope", "error: cannot read outputs of stack 'nope': error: no stack named 'nope' found"),
        ("half", "error: stack 'half' is missing outputs: nfs_private_ip, data_sas, nccl_env"),
    ],
)
def test_cli_from_stack_faults(tmp_path, stack, expected):
    proc = run_module(
        "dtrain", "cluster", "from-stack", "--stack", stack, "-o", str(tmp_path / "c.json"),
        "--ssh-key", str(private_key_file(tmp_path)), env={"PATH": FAKE_PULUMI_PATH}, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    ("credential", "problem"),
    [
        ({"kind": "managed_identity"}, "a managed_identity credential needs client_id"),
        (
            {"kind": "managed_identity", "client_id": "c", "secret": "s"},
            "a managed_identity credential carries no secret",
        ),
        ({"kind": "entra_id", "client_id": "c"}, "client_id belongs to a managed_identity credential, not to entra_id"),
        ({"kind": "sas"}, "a sas credential needs its secret"),
    ],
)
def test_credentials_carry_what_their_kind_needs(credential, problem):
    with pytest.raises(ValidationError, match=problem):
        BlobCredential.model_validate(credential)


def test_jobs_upload_results_with_a_sas_or_the_cluster_identity_only():
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k")
    local = desc.model_copy(update={"results_upload": BlobCredential(kind="sas", secret=SecretStr("sp=cw&sig=x"))})
    assert ClusterDescription.model_validate(local.model_dump(context={"reveal_secrets": True})) == local
    for kind in ("entra_id", "connection_string"):
        data = desc.model_dump(context={"reveal_secrets": True})
        data["results_upload"] = {"kind": kind, "secret": "s" if kind == "connection_string" else None}
        with pytest.raises(ValidationError, match="results_upload must be of kind 'sas' or 'managed_identity'"):
            ClusterDescription.model_validate(data)


def test_a_description_of_an_older_schema_is_named(tmp_path):
    data = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k").model_dump(mode="json", context={"reveal_secrets": True})
    data |= {"schema_version": 1, "node_registry_path": "/shared/nodes"}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    with pytest.raises(OperatorError, match=r"has schema version 1, this version reads 2: write it again"):
        cl.load(old)


def test_ssh_config_reaches_every_host_through_the_jump_host(tmp_path):
    """The hosts the CLI reaches: jump host, NFS server, Slurm login node, and nodes by name (resolved
    on the jump host) or by a given address. Checked with `ssh -G`, OpenSSH's own reading of the config."""
    key = private_key_file(tmp_path)
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key=key, known_hosts=tmp_path / "kh")

    def resolved(ssh: SSH, alias: str) -> dict[str, str]:
        out = subprocess.run(["ssh", "-F", str(ssh.config_path), "-G", alias], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)

    with SSH(desc, addresses={"vmss000001": "10.20.1.6"}) as ssh:
        jump = resolved(ssh, ssh.jump.alias)
        assert (jump["hostname"], jump["port"], jump["user"]) == ("20.51.100.7", "22", "azureuser")
        assert "proxyjump" not in jump
        expected = {
            ssh.storage: "10.20.2.4",
            ssh.login: "10.20.1.4",
            ssh.node("vmss000000"): "vmss000000",  # Azure's DNS on the jump host's side knows the name
            ssh.node("vmss000001"): "10.20.1.6",
        }
        for target, host in expected.items():
            options = resolved(ssh, target.alias)
            assert (options["hostname"], options["proxyjump"], options["user"]) == (host, "jump_host", "azureuser")
            assert options["identityfile"] == str(key) and options["batchmode"] == "yes"
        assert ssh.login.label == "Slurm login host azureuser@10.20.1.4:22"
        assert ssh.node("vmss000000").alias == "vmss000000"
        with pytest.raises(OperatorError, match="invalid node name"):
            ssh.node("jump_host")  # never a name that could stand for another host, or inject config
        with pytest.raises(OperatorError, match="invalid node name"):
            ssh.node("a\n ProxyCommand evil")


def test_a_login_host_that_is_the_jump_host_is_reached_directly(tmp_path):
    desc = cl.from_stack_outputs(OUTPUTS, "dev", ssh_key=private_key_file(tmp_path), known_hosts=tmp_path / "kh")
    local_like = desc.model_copy(update={"slurm": desc.slurm.model_copy(update={"login": desc.jump_host})})
    with SSH(local_like) as ssh:
        out = subprocess.run(["ssh", "-F", str(ssh.config_path), "-G", ssh.login.alias], capture_output=True, text=True)
    assert "hostname 20.51.100.7" in out.stdout.splitlines() and "proxyjump" not in out.stdout
    no_slurm = desc.model_copy(update={"slurm": None})
    with SSH(no_slurm) as ssh, pytest.raises(OperatorError, match="has no Slurm") as err:
        ssh.login  # noqa: B018
    assert err.value.exit_code == 3


def test_results_go_where_the_stack_says_a_kept_account_or_its_own(tmp_path):
    kept = "https://hvdoldsa9e8d7c.blob.core.windows.net/"
    key = private_key_file(tmp_path)
    desc = cl.from_stack_outputs({**OUTPUTS, "results_blob_endpoint": kept}, "dev", ssh_key=key)
    assert desc.results.url == f"{kept}results" and desc.data.url.startswith(OUTPUTS["blob_endpoint"])
    # a stack deployed before the output existed: results in its own account
    older = {name: value for name, value in OUTPUTS.items() if name != "results_blob_endpoint"}
    assert cl.from_stack_outputs(older, "dev", ssh_key=key).results.url == f"{OUTPUTS['blob_endpoint']}results"


def test_every_output_the_cli_reads_is_one_the_stack_declares():
    # infra/contract.py names the stack's outputs; the CLI must not read one the stack never exports,
    # and the recorded outputs the tests use are exactly the stack's.
    assert cl.REQUIRED_OUTPUTS and set(cl.REQUIRED_OUTPUTS) <= set(StackOutput)
    assert set(OUTPUTS) == set(StackOutput)
