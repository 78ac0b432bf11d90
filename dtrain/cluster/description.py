"""The cluster description: the one seam between "a cluster exists" and everything that uses it.

Two producers write it (JSON on disk, mode 0600 because it holds secrets: the read-only data SAS,
and locally the results SAS):
  * `from_stack_outputs` / `from_pulumi_stack`: the outputs of a Pulumi stack (Azure);
  * `python -m dtrain local up`: the embedded local cluster.
Staging, launch, logs and results read only this. Nodes are not listed: Slurm knows them.
The command `cluster` (`from-stack`, `show`, `for-user`) that writes and prints it is dtrain/cli/cluster.py.
Runs on the operator's machine.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import stat
import subprocess
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from dtrain.checks import describe_validation_error, read_json_file, require_tool
from dtrain.cluster.slurm_time import check_max_time, check_time_limit
from dtrain.errors import ExitCode, OperatorError, explain_os_error
from dtrain.fileio import atomic_write
from infra import slurm_time
from infra.contract import CONTAINER_SSH_PORT, MLFLOW_PORT, PROMETHEUS_PORT
from infra.slurm_time import DEFAULT_JOB_TIME, UNLIMITED, exceeds
from infra.users import check_user_name

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where `cluster from-stack` writes an Azure description by default: outside the repository, so that
# neither git nor `images` (az acr build .) can carry its SAS anywhere.
CONFIG_DIR_NAME = "azure-horovod"
# The local cluster's state (its description, which holds an Azurite SAS, its SSH keys, its logs) is
# the user's state, kept outside the repository for the same reason: $XDG_STATE_HOME, else ~/.local/state.
DEFAULT_LOCAL_STATE = (
    Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state").expanduser()
    / CONFIG_DIR_NAME
    / "local-cluster"
)
DEFAULT_DESCRIPTION = DEFAULT_LOCAL_STATE / "cluster.json"
# Image repository per framework in the registry; the Keras job runs in the TensorFlow image.
IMAGE_REPOSITORIES = {"pytorch": "hvd-pytorch", "tensorflow": "hvd-tensorflow", "keras": "hvd-tensorflow"}
# Version 2: the node registry went (Slurm knows the nodes), `results_upload` came, `storage_python`
# became `remote_python`.
SCHEMA_VERSION = 2
DEFAULT_IDLE_GPU_WINDOW_S = 600  # 10 minutes: long enough for a checkpoint or an evaluation, short against the cost
DOCKER_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # Docker's grammar for an image tag


def check_image_tag(tag: str) -> str:
    if not DOCKER_TAG.fullmatch(tag):
        raise OperatorError(
            f"invalid image tag {tag!r}: up to 128 letters, digits, '_', '.' and '-', not starting with '.' or '-'"
        )
    return tag


def user_config_dir() -> Path:
    """$XDG_CONFIG_HOME/azure-horovod, else ~/.config/azure-horovod (the operator's own, not the repository)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / CONFIG_DIR_NAME


def check_outside_repository(path: Path, what: str) -> None:
    """Refuse a secret-holding file inside this repository: git could commit it and `images` uploads it."""
    resolved = path.expanduser().resolve()
    if resolved.is_relative_to(REPO_ROOT):
        raise OperatorError(
            f"{what} {path} is inside the repository {REPO_ROOT}, and the file holds the data SAS "
            f"(git or `images` could carry it away): write it outside, e.g. {user_config_dir()}/"
        )


def check_private_key(path: str | Path) -> Path:
    """The operator's SSH private key: a readable file that ssh will accept (not readable by others)."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        if stat.S_ISREG(mode):  # (opening a FIFO would block)
            path.open("rb").close()
    except OSError as exc:
        raise explain_os_error(exc, "use the SSH key") from None
    if not stat.S_ISREG(mode):
        raise OperatorError(f"SSH key {path} is not a file: pass the private key (e.g. ~/.ssh/id_ed25519)")
    if mode & 0o077:
        raise OperatorError(
            f"SSH key {path} is readable by other users (mode {stat.S_IMODE(mode):04o}) and ssh refuses such "
            f"keys: run `chmod 600 {path}`"
        )
    return path


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SSHEndpoint(_Model):
    """A host the operator reaches over SSH (the jumpbox, the NFS server)."""

    host: str
    user: str
    port: int = 22


class BlobCredential(_Model):
    """How a blob container is accessed.

    sas: a SAS token (no leading '?'); connection_string: an account connection string (Azurite);
    entra_id: the operator's Entra ID login (az login or the environment, through azure-identity's
    DefaultAzureCredential); managed_identity: the user-assigned managed identity whose client_id
    is given (the cluster's, used on the cluster's hosts through their metadata endpoint).
    """

    kind: Literal["sas", "connection_string", "entra_id", "managed_identity"]
    secret: SecretStr | None = None
    client_id: str | None = None

    @model_validator(mode="after")
    def _fits_kind(self) -> BlobCredential:
        has_secret = bool(self.secret and self.secret.get_secret_value())
        if self.kind in ("sas", "connection_string") and not has_secret:
            raise ValueError(f"a {self.kind} credential needs its secret")
        if self.kind in ("entra_id", "managed_identity") and self.secret is not None:
            raise ValueError(f"a {self.kind} credential carries no secret")
        if self.kind == "managed_identity" and not self.client_id:
            raise ValueError("a managed_identity credential needs client_id (the identity's client id)")
        if self.kind != "managed_identity" and self.client_id is not None:
            raise ValueError(f"client_id belongs to a managed_identity credential, not to {self.kind}")
        return self

    @field_serializer("secret", when_used="always")
    def _dump_secret(self, value: SecretStr | None, info: Any) -> str | None:
        if value is None:
            return None
        reveal = bool(info.context and info.context.get("reveal_secrets"))
        return value.get_secret_value() if reveal else "***"


class BlobLocation(_Model):
    endpoint: str  # account URL: https://ACCOUNT.blob.core.windows.net or http://127.0.0.1:PORT/devstoreaccount1
    container: str
    credential: BlobCredential

    @property
    def url(self) -> str:
        return f"{self.endpoint.rstrip('/')}/{self.container}"


class Runtime(_Model):
    """How jobs run on the nodes.

    docker: one container per node (host network, IB devices, shared mount), image per framework;
            horovodrun talks to the containers' sshd on ssh_port.
    host:   the training environment on the node itself (python below), node sshd on the node's port.
    """

    kind: Literal["docker", "host"]
    images: dict[str, str] = Field(default_factory=dict)  # framework -> image reference (docker)
    python: str = "python3"  # interpreter with torch/tensorflow/horovod (host) or inside the image
    workdir: str  # where the training code (the `training` package) lives, on the node or in the image
    ssh_port: int | None = None  # docker: the containers' sshd port; host: None (each node's own)
    identity_file: str | None = None  # host: private key on the nodes for node-to-node SSH
    network_interface: str | None = None  # interface for gloo/NCCL sockets (None: let Horovod probe)


class SlurmAccess(_Model):
    """The cluster's Slurm: its controller, its partitions, and where its commands are run."""

    cluster_name: str
    partition: str
    spot_partition: str | None = None  # Spot nodes (`launch --spot`); None: the cluster has none
    controller_host: str
    controller_address: str  # slurmctld listens on contract.SLURMCTLD_PORT there
    login: SSHEndpoint  # where sbatch, squeue, scontrol run: the head node (Azure), this machine (local)
    conf: str | None = None  # SLURM_CONF on the login host; None: Slurm's default, /etc/slurm/slurm.conf


class Telemetry(_Model):
    """The cluster's Prometheus (infra/cloud_init/prometheus.py), and when `jobs` calls a running job idle."""

    prometheus_url: str  # as the Slurm login host reaches it
    # `jobs` marks a running job whose GPUs have all been idle this long (`jobs --idle-window` overrides)
    idle_gpu_window_s: int = Field(default=DEFAULT_IDLE_GPU_WINDOW_S, ge=10, le=86400)


class ClusterDescription(_Model):
    schema_version: Literal[2] = SCHEMA_VERSION
    name: str
    provider: Literal["azure", "local"]
    # SSH from the operator's machine
    ssh_user: str
    ssh_key: str  # private key path on the operator's machine
    known_hosts: str  # known_hosts file kept for this cluster (host keys are accepted on first use)
    jump_host: SSHEndpoint | None = None  # None: every host is reached directly
    # what fills the shared file system from blob (blob-pull): the NFS server, or with Lustre the head node
    storage_host: SSHEndpoint
    shared_storage: Literal["nfs", "lustre"] = "nfs"  # what /shared is on the Azure stack (sharedStorage)
    # nodes
    node_count: int = Field(ge=1)
    gpus_per_node: int = Field(ge=0)
    # the CPUs a node offers to jobs (Slurm's CPUs=), where the description knows them: more processes
    # a node are refused before any connection, --dry-run too. None: Slurm says at submission (on
    # Azure a process needs a GPU, and every size has more vCPUs than GPUs)
    node_cpus: int | None = Field(default=None, ge=1)
    gpu_sku: str | None = None
    region: str | None = None  # with gpu_sku, what prices a run (dtrain/pricing.py); None locally
    expect_infiniband: bool = False
    node_ssh_port: int = 22
    # shared file system, as the nodes see it, and as the NFS server sees it
    shared_mount_path: str
    shared_is_mount: bool = True  # nodes must have it mounted (locally it is a plain directory)
    storage_export_path: str  # the directory on storage_host that nodes mount at shared_mount_path
    data_path: str
    local_data_path: str | None = None  # the same path on every node, each node's own copy (launch --local-copy)
    blob_pull: list[str]  # the blob-pull command on storage_host
    remote_python: str = "python3"  # a stdlib python3 on every cluster host (runs dtrain/remote/)
    # blob storage
    data: BlobLocation  # the `data` container with the read-only (read + list) SAS
    staging_credential: BlobCredential  # what the operator writes the `data` container with
    results: BlobLocation  # the `results` container and the operator's credential for it (reading runs)
    results_upload: BlobCredential  # how jobs on the cluster write the `results` container
    # jobs
    slurm: SlurmAccess | None = None  # None: no Slurm (the local cluster's fallback mode)
    runtime: Runtime
    nccl_env: dict[str, str] = Field(default_factory=dict)
    tracking_uri: str | None = None  # the cluster's MLflow server, as the nodes reach it (None: none)
    min_free_disk_gb: float = 20.0
    # the time limit of a job that names none (`launch --time`), in Slurm's --time syntax, and the
    # longest a job may ask for (the partitions' MaxTime; INFINITE: no cap). A description written
    # before these came from the stack has the stack's defaults, which its slurm.conf has too.
    default_time_limit: str = DEFAULT_JOB_TIME
    max_time_limit: str = UNLIMITED
    telemetry: Telemetry | None = None  # None: no Prometheus (the local cluster's fallback mode)

    @model_validator(mode="after")
    def _paths(self) -> ClusterDescription:
        for name in ("shared_mount_path", "storage_export_path", "data_path", "local_data_path"):
            if getattr(self, name) is not None and not posixpath.isabs(getattr(self, name)):
                raise ValueError(f"{name} must be an absolute path")
        if self.data.credential.kind != "sas":
            raise ValueError("data.credential must be the read-only SAS (kind 'sas')")
        # the upload runs on the cluster's hosts with the standard library only: a SAS or an IMDS token
        if self.results_upload.kind not in ("sas", "managed_identity"):
            raise ValueError("results_upload must be of kind 'sas' or 'managed_identity'")
        if self.runtime.kind == "docker" and not self.runtime.ssh_port:
            raise ValueError("the docker runtime needs runtime.ssh_port (the containers' sshd)")
        self._check_time_limits()
        return self

    def _check_time_limits(self) -> None:
        try:
            check_time_limit(self.default_time_limit)
        except OperatorError as exc:
            raise ValueError(f"default_time_limit: {exc}") from None
        try:
            self.max_time_limit = check_max_time(self.max_time_limit)
        except OperatorError as exc:
            raise ValueError(f"max_time_limit: {exc}") from None
        if exceeds(self.default_time_limit, self.max_time_limit):
            raise ValueError(
                f"default_time_limit {self.default_time_limit} is longer than max_time_limit {self.max_time_limit}, "
                "the longest a job may run on the cluster"
            )

    def on_storage_host(self, node_path: str) -> str:
        """The storage host's path for a path under the nodes' shared mount (/mnt/shared/x -> /export/x)."""
        rel = posixpath.relpath(node_path, self.shared_mount_path)
        if rel == "." or rel.startswith(".."):
            if rel == ".":
                return self.storage_export_path
            raise OperatorError(f"{node_path} is not under the shared mount {self.shared_mount_path}")
        return posixpath.join(self.storage_export_path, rel)

    def image_for(self, framework: str) -> str | None:
        return self.runtime.images.get(framework)

    # --- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        text = json.dumps(self.model_dump(mode="json", context={"reveal_secrets": True}), indent=2)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, text + "\n", 0o600)
        except OSError as exc:
            raise explain_os_error(exc, "write the cluster description") from None
        return path

    def masked(self) -> dict[str, Any]:
        """The description with every secret replaced by ***, safe to print or log."""
        return self.model_dump(mode="json")


def load(path: str | Path | None = None) -> ClusterDescription:
    """Read a description; path defaults to $CLUSTER_DESCRIPTION, then the local cluster's."""
    path = Path(path or os.environ.get("CLUSTER_DESCRIPTION") or DEFAULT_DESCRIPTION).expanduser()
    if not path.exists():
        raise OperatorError(
            f"no cluster description at {path}: run `dtrain local up` (local) or "
            "`dtrain cluster from-stack --stack NAME -o FILE` (Azure), or pass --cluster FILE"
        )
    data = read_json_file(path, "cluster description")
    if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise OperatorError(
            f"cluster description {path} has schema version {data['schema_version']!r}, this version reads "
            f"{SCHEMA_VERSION}: write it again (`dtrain cluster from-stack`, or `local down`, `local up`)"
        )
    try:
        return ClusterDescription.model_validate(data)
    except ValidationError as exc:
        raise OperatorError(f"invalid cluster description {path}: {describe_validation_error(exc)}") from None


# --- producer 1: a Pulumi stack's outputs ------------------------------------------------------
class StackOutputs(BaseModel):
    """The outputs a description is made from, typed, so that a wrong one is named (node_count "two")."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)

    jumpbox_public_ip: str
    admin_user: str
    head_private_ip: str
    head_hostname: str
    slurm_cluster_name: str
    slurm_partition: str
    spot_partition: str | None = None  # absent or None: no Spot nodes
    # absent in a stack deployed before they were outputs: its slurm.conf has these defaults
    default_job_time: str = DEFAULT_JOB_TIME
    max_job_time: str = UNLIMITED
    # a stack deployed before sharedStorage had NFS
    shared_storage: Literal["nfs", "lustre"] = "nfs"
    nfs_private_ip: str | None = None  # with NFS only
    nfs_export_path: str | None = None
    shared_mount_path: str
    data_path: str
    local_data_path: str
    blob_endpoint: str
    # absent in a stack deployed before it was an output: results were in blob_endpoint's account
    results_blob_endpoint: str | None = None
    data_container: str
    results_container: str
    data_sas: SecretStr
    acr_login_server: str
    node_count: int = Field(ge=1)
    gpus_per_node: int = Field(ge=0)
    gpu_sku: str
    location: str
    cluster_identity_client_id: str
    nccl_env: dict[str, str]

    _job_time = field_validator("default_job_time")(slurm_time.check_time_limit)
    _max_job_time = field_validator("max_job_time")(slurm_time.check_max_time)

    @property
    def storage(self) -> tuple[str, str]:
        """(the host that fills the shared file system from blob, the shared file system's path there): the NFS
        server and its export, or with Lustre the head node, which mounts it where the nodes do."""
        if self.shared_storage == "lustre":
            return self.head_private_ip, self.shared_mount_path
        assert self.nfs_private_ip and self.nfs_export_path  # required of an NFS stack (_validated_outputs)
        return self.nfs_private_ip, self.nfs_export_path


REQUIRED_OUTPUTS = tuple(name for name, field in StackOutputs.model_fields.items() if field.is_required())
NFS_OUTPUTS = ("nfs_private_ip", "nfs_export_path")  # required of an NFS stack, None on a Lustre one


def from_stack_outputs(
    outputs: dict[str, Any],
    stack: str,
    ssh_key: str | Path,
    known_hosts: str | Path | None = None,
    runtime: Literal["docker", "host"] = "docker",
    image_tag: str = "latest",
    default_time_limit: str | None = None,
) -> ClusterDescription:
    """Map `pulumi stack output --json --show-secrets` to a description; name any missing or invalid output.
    default_time_limit: a job's time limit when it names none (None: the stack's defaultJobTime)."""
    check_image_tag(image_tag)
    out = _validated_outputs(outputs, stack)
    _check_default_time(default_time_limit, out, stack)
    user = out.admin_user
    known = Path(known_hosts) if known_hosts else Path.home() / ".ssh" / f"known_hosts.{stack}"
    try:
        return ClusterDescription(
            name=stack,
            provider="azure",
            ssh_user=user,
            ssh_key=str(Path(ssh_key).expanduser()),
            known_hosts=str(known.expanduser()),
            jump_host=SSHEndpoint(host=out.jumpbox_public_ip, user=user),
            storage_host=SSHEndpoint(host=out.storage[0], user=user),
            shared_storage=out.shared_storage,
            node_count=out.node_count,
            gpus_per_node=out.gpus_per_node,
            gpu_sku=out.gpu_sku,
            region=out.location,
            expect_infiniband=True,  # every SKU the stack accepts is an InfiniBand SKU
            shared_mount_path=out.shared_mount_path,
            shared_is_mount=True,
            storage_export_path=out.storage[1],
            data_path=out.data_path,
            local_data_path=out.local_data_path,
            # the data directory belongs to root (the NFS server's, the head node's): the admin user pulls with
            # sudo (-n: never prompt)
            blob_pull=["sudo", "-n", "blob-pull"],
            data=BlobLocation(
                endpoint=out.blob_endpoint,
                container=out.data_container,
                credential=BlobCredential(kind="sas", secret=SecretStr(out.data_sas.get_secret_value().lstrip("?"))),
            ),
            staging_credential=BlobCredential(kind="entra_id"),
            results=BlobLocation(
                endpoint=out.results_blob_endpoint or out.blob_endpoint,
                container=out.results_container,
                credential=BlobCredential(kind="entra_id"),
            ),
            # jobs write their results from the nodes with the cluster's identity: no secret on the cluster
            results_upload=BlobCredential(kind="managed_identity", client_id=out.cluster_identity_client_id),
            slurm=_stack_slurm(out),
            telemetry=Telemetry(prometheus_url=f"http://{out.head_private_ip}:{PROMETHEUS_PORT}"),
            runtime=_stack_runtime(out, runtime, image_tag),
            nccl_env=out.nccl_env,
            min_free_disk_gb=50.0,
            default_time_limit=default_time_limit or out.default_job_time,
            max_time_limit=out.max_job_time,
            tracking_uri=f"http://{out.head_private_ip}:{MLFLOW_PORT}",  # the head's MLflow (infra/head.py)
        )
    except ValidationError as exc:
        raise OperatorError(
            f"stack {stack!r}: outputs do not make a valid cluster description: {describe_validation_error(exc)}"
        ) from None


def _validated_outputs(outputs: dict[str, Any], stack: str) -> StackOutputs:
    nfs = outputs.get("shared_storage") in (None, "nfs")
    required = [key for key in StackOutputs.model_fields if key in REQUIRED_OUTPUTS or (nfs and key in NFS_OUTPUTS)]
    missing = [key for key in required if outputs.get(key) in (None, "")]
    if missing:
        raise OperatorError(f"stack {stack!r} is missing outputs: {', '.join(missing)} (did `pulumi up` finish?)")
    try:
        return StackOutputs.model_validate(outputs)
    except ValidationError as exc:
        raise OperatorError(f"stack {stack!r} has invalid outputs: {describe_validation_error(exc)}") from None


def _check_default_time(default_time_limit: str | None, out: StackOutputs, stack: str) -> None:
    """--default-time, if given, within the stack's maxJobTime."""
    if default_time_limit and exceeds(check_time_limit(default_time_limit), out.max_job_time):
        raise OperatorError(
            f"--default-time {default_time_limit} is longer than the maxJobTime of stack {stack!r}, "
            f"{out.max_job_time}, the longest a job may run there: give a shorter one"
        )


def _stack_slurm(out: StackOutputs) -> SlurmAccess:
    """The head node runs slurmctld and is the login node, with Slurm's default slurm.conf."""
    return SlurmAccess(
        cluster_name=out.slurm_cluster_name,
        partition=out.slurm_partition,
        spot_partition=out.spot_partition,
        controller_host=out.head_hostname,
        controller_address=out.head_private_ip,
        login=SSHEndpoint(host=out.head_private_ip, user=out.admin_user),
    )


def _stack_runtime(out: StackOutputs, kind: Literal["docker", "host"], image_tag: str) -> Runtime:
    if kind == "docker":
        return Runtime(
            kind="docker",
            images={fw: f"{out.acr_login_server}/{repo}:{image_tag}" for fw, repo in IMAGE_REPOSITORIES.items()},
            python="python",
            workdir="/workspace",
            ssh_port=CONTAINER_SSH_PORT,
            network_interface="eth0",
        )
    return Runtime(
        kind="host",
        python="/opt/hvd-venv/bin/python",
        workdir=posixpath.join(out.shared_mount_path, "code"),
        identity_file=f"/home/{out.admin_user}/.ssh/id_ed25519",
        network_interface="eth0",
    )


def pulumi_stack_outputs(stack: str, cwd: str | Path = REPO_ROOT, timeout: float = 60) -> dict[str, Any]:
    """`pulumi stack output --json --show-secrets --stack NAME` (the only boundary tests mock)."""
    cmd = ["pulumi", "stack", "output", "--json", "--show-secrets", "--stack", stack]
    require_tool("pulumi", "install the Pulumi CLI (https://www.pulumi.com/docs/install/)")
    if not Path(cwd).is_dir():
        raise OperatorError(f"the Pulumi project directory {cwd} does not exist (--cwd)")
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OperatorError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f}s", ExitCode.TIMED_OUT) from None
    if proc.returncode != 0:
        detail = " ".join((proc.stderr or proc.stdout).strip().splitlines()) or "pulumi failed"
        # a wrong stack name is the operator's input; anything else (login, backend) is the environment
        code = ExitCode.BAD_INPUT if "no stack named" in detail else ExitCode.NOT_READY
        raise OperatorError(f"cannot read outputs of stack {stack!r}: {detail}", code)
    try:
        outputs = json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        raise OperatorError(f"pulumi returned no JSON for stack {stack!r}", ExitCode.FAILED) from None
    if not isinstance(outputs, dict) or not outputs:
        raise OperatorError(f"stack {stack!r} has no outputs (has `pulumi up` run?)")
    return outputs


def from_pulumi_stack(stack: str, ssh_key: str | Path, **kwargs: Any) -> ClusterDescription:
    cwd = kwargs.pop("cwd", REPO_ROOT)
    return from_stack_outputs(pulumi_stack_outputs(stack, cwd=cwd), stack, ssh_key, **kwargs)


def check_person_name(name: str) -> str:
    """A name the cluster's users list may hold (infra/users.py's rule)."""
    try:
        return check_user_name(name)
    except ValueError as exc:
        raise OperatorError(str(exc)) from None


def for_user(desc: ClusterDescription, user: str, ssh_key: str | Path) -> ClusterDescription:
    """The description a person of the cluster's users list (`dtrain users`) works with: their name on every
    host and their own key; the admin's key stays the operators'. A person has no sudo: they pull datasets
    into the dataset area as themselves (every person may write it once the cluster has users)."""
    check_person_name(user)
    if user == desc.ssh_user:
        raise OperatorError(f"--user {user} is the cluster's admin user: the admin's description is the one to use")

    def as_user(endpoint: SSHEndpoint) -> SSHEndpoint:
        return endpoint.model_copy(update={"user": user})

    sudo = ["sudo", "-n"]
    update: dict[str, Any] = {
        "ssh_user": user,
        "ssh_key": str(Path(ssh_key).expanduser()),
        "jump_host": as_user(desc.jump_host) if desc.jump_host else None,
        "storage_host": as_user(desc.storage_host),
        "blob_pull": desc.blob_pull[len(sudo) :] if desc.blob_pull[: len(sudo)] == sudo else desc.blob_pull,
        "runtime": desc.runtime.model_copy(update={"identity_file": None}),  # the admin's, on the nodes
    }
    if desc.slurm:
        update["slurm"] = desc.slurm.model_copy(update={"login": as_user(desc.slurm.login)})
    return desc.model_copy(update=update)


def default_ssh_key() -> str:
    for name in ("id_ed25519", "id_rsa", "id_ecdsa"):
        candidate = Path.home() / ".ssh" / name
        if candidate.exists():
            return str(candidate)
    return str(Path.home() / ".ssh" / "id_ed25519")
