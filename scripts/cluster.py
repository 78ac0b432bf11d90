"""The cluster description: the one seam between "a cluster exists" and everything that uses it.

Two producers write it (JSON on disk, mode 0600 because it holds the read-only data SAS):
  * `from_stack_outputs` / `from_pulumi_stack`: the outputs of a Pulumi stack (Azure);
  * `scripts.local_cluster up`: the embedded local cluster.
Staging, launch, logs and results read only this. Nodes themselves are not listed here: they
come and go, and are found at launch time in the node registry (one JSON file per node on the
shared file system), see `NodeRecord`.

CLI:
  python -m scripts.cluster from-stack --stack dev --ssh-key ~/.ssh/id_ed25519 -o cluster-dev.json
  python -m scripts.cluster show [--cluster FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_serializer, model_validator

from scripts.errors import OperatorError, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LOCAL_STATE = REPO_ROOT / ".local-cluster"
DEFAULT_DESCRIPTION = DEFAULT_LOCAL_STATE / "cluster.json"
FRAMEWORKS = ("pytorch", "tensorflow", "keras")
# Image repository per framework in the registry; the Keras job runs in the TensorFlow image.
IMAGE_REPOSITORIES = {"pytorch": "hvd-pytorch", "tensorflow": "hvd-tensorflow", "keras": "hvd-tensorflow"}
CONTAINER_SSH_PORT = 12345  # sshd inside the job containers, used by horovodrun between nodes


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
    entra_id: the caller's Entra ID login (az login / environment / managed identity, through
    azure-identity's DefaultAzureCredential; client_id selects a user-assigned managed identity).
    """

    kind: Literal["sas", "connection_string", "entra_id"]
    secret: SecretStr | None = None
    client_id: str | None = None

    @model_validator(mode="after")
    def _secret_present(self) -> BlobCredential:
        if self.kind in ("sas", "connection_string") and not (self.secret and self.secret.get_secret_value()):
            raise ValueError(f"a {self.kind} credential needs its secret")
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


class NodeRecord(BaseModel):
    """One node registry file, `<node_registry_path>/<hostname>.json` (written by cloud-init on Azure,
    by `local_cluster up` locally)."""

    model_config = ConfigDict(extra="ignore")

    hostname: str
    address: str
    gpus: int = 0
    ib_state: Literal["ACTIVE", "DOWN", "absent"] = "absent"
    ready_at: datetime
    ssh_port: int | None = None  # local fallback mode only: the node's sshd port


class ClusterDescription(_Model):
    schema_version: Literal[1] = 1
    name: str
    provider: Literal["azure", "local"]
    # SSH from the operator's machine
    ssh_user: str
    ssh_key: str  # private key path on the operator's machine
    known_hosts: str  # known_hosts file kept for this cluster (host keys are accepted on first use)
    jump_host: SSHEndpoint | None = None  # None: nodes are reached directly
    storage_host: SSHEndpoint  # the NFS server: holds the node registry and pulls the dataset
    # nodes
    node_count: int = Field(ge=1)
    gpus_per_node: int = Field(ge=0)
    gpu_sku: str | None = None
    expect_infiniband: bool = False
    expected_hostnames: list[str] = Field(default_factory=list)  # known up front only locally
    node_ssh_port: int = 22
    # shared file system, as the nodes see it, and as the NFS server sees it
    shared_mount_path: str
    shared_is_mount: bool = True  # nodes must have it mounted (locally it is a plain directory)
    storage_export_path: str  # the directory on storage_host that nodes mount at shared_mount_path
    node_registry_path: str
    data_path: str
    blob_pull: list[str]  # the blob-pull command on storage_host
    storage_python: str = "python3"  # an interpreter on storage_host (reads the node registry)
    # blob storage
    data: BlobLocation  # the `data` container with the read-only (read + list) SAS
    staging_credential: BlobCredential  # what the operator writes the `data` container with
    results: BlobLocation  # the `results` container and the operator's credential for it
    # jobs
    runtime: Runtime
    nccl_env: dict[str, str] = Field(default_factory=dict)
    min_free_disk_gb: float = 20.0

    @model_validator(mode="after")
    def _paths(self) -> ClusterDescription:
        for name in ("shared_mount_path", "storage_export_path", "node_registry_path", "data_path"):
            if not posixpath.isabs(getattr(self, name)):
                raise ValueError(f"{name} must be an absolute path")
        if self.data.credential.kind != "sas":
            raise ValueError("data.credential must be the read-only SAS (kind 'sas')")
        if self.runtime.kind == "docker" and not self.runtime.ssh_port:
            raise ValueError("the docker runtime needs runtime.ssh_port (the containers' sshd)")
        return self

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
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.model_dump(mode="json", context={"reveal_secrets": True}), indent=2)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text + "\n")
        os.replace(tmp, path)
        return path

    def masked(self) -> dict[str, Any]:
        """The description with every secret replaced by ***, safe to print or log."""
        return self.model_dump(mode="json")


def load(path: str | Path | None = None) -> ClusterDescription:
    """Read a description; path defaults to $CLUSTER_DESCRIPTION, then the local cluster's."""
    path = Path(path or os.environ.get("CLUSTER_DESCRIPTION") or DEFAULT_DESCRIPTION)
    if not path.is_file():
        raise OperatorError(
            f"no cluster description at {path}: run `python -m scripts.local_cluster up` (local) or "
            "`python -m scripts.cluster from-stack --stack NAME -o FILE` (Azure), or pass --cluster FILE"
        )
    try:
        return ClusterDescription.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise OperatorError(f"invalid cluster description {path}:\n{exc}") from None


# --- producer 1: a Pulumi stack's outputs ------------------------------------------------------
REQUIRED_OUTPUTS = (
    "jumpbox_public_ip",
    "admin_user",
    "nfs_private_ip",
    "nfs_export_path",
    "shared_mount_path",
    "data_path",
    "node_registry_path",
    "blob_endpoint",
    "data_container",
    "results_container",
    "data_sas",
    "acr_login_server",
    "node_count",
    "gpus_per_node",
    "gpu_sku",
    "nccl_env",
)


def from_stack_outputs(
    outputs: dict[str, Any],
    stack: str,
    ssh_key: str | Path,
    known_hosts: str | Path | None = None,
    runtime: Literal["docker", "host"] = "docker",
    image_tag: str = "latest",
) -> ClusterDescription:
    """Map `pulumi stack output --json --show-secrets` to a description; name any missing output."""
    missing = [key for key in REQUIRED_OUTPUTS if outputs.get(key) in (None, "")]
    if missing:
        raise OperatorError(f"stack {stack!r} is missing outputs: {', '.join(missing)} (did `pulumi up` finish?)")
    if not isinstance(outputs["nccl_env"], dict):
        raise OperatorError(f"stack {stack!r}: output nccl_env must be a map, got {outputs['nccl_env']!r}")
    user = str(outputs["admin_user"])
    registry = str(outputs["acr_login_server"])
    sas = str(outputs["data_sas"]).lstrip("?")
    known = Path(known_hosts) if known_hosts else Path.home() / ".ssh" / f"known_hosts.{stack}"
    if runtime == "docker":
        job_runtime = Runtime(
            kind="docker",
            images={fw: f"{registry}/{repo}:{image_tag}" for fw, repo in IMAGE_REPOSITORIES.items()},
            python="python",
            workdir="/workspace",
            ssh_port=CONTAINER_SSH_PORT,
            network_interface="eth0",
        )
    else:
        job_runtime = Runtime(
            kind="host",
            python="/opt/hvd-venv/bin/python",
            workdir=posixpath.join(str(outputs["shared_mount_path"]), "code"),
            identity_file=f"/home/{user}/.ssh/id_ed25519",
            network_interface="eth0",
        )
    try:
        return ClusterDescription(
            name=stack,
            provider="azure",
            ssh_user=user,
            ssh_key=str(Path(ssh_key).expanduser()),
            known_hosts=str(known.expanduser()),
            jump_host=SSHEndpoint(host=str(outputs["jumpbox_public_ip"]), user=user),
            storage_host=SSHEndpoint(host=str(outputs["nfs_private_ip"]), user=user),
            node_count=int(outputs["node_count"]),
            gpus_per_node=int(outputs["gpus_per_node"]),
            gpu_sku=str(outputs["gpu_sku"]),
            expect_infiniband=True,  # every SKU the stack accepts is an InfiniBand SKU
            shared_mount_path=str(outputs["shared_mount_path"]),
            shared_is_mount=True,
            storage_export_path=str(outputs["nfs_export_path"]),
            node_registry_path=str(outputs["node_registry_path"]),
            data_path=str(outputs["data_path"]),
            # /export/data belongs to root on the NFS server: the admin user pulls with sudo (-n: never prompt)
            blob_pull=["sudo", "-n", "blob-pull"],
            data=BlobLocation(
                endpoint=str(outputs["blob_endpoint"]),
                container=str(outputs["data_container"]),
                credential=BlobCredential(kind="sas", secret=SecretStr(sas)),
            ),
            staging_credential=BlobCredential(kind="entra_id"),
            results=BlobLocation(
                endpoint=str(outputs["blob_endpoint"]),
                container=str(outputs["results_container"]),
                credential=BlobCredential(kind="entra_id"),
            ),
            runtime=job_runtime,
            nccl_env={str(k): str(v) for k, v in outputs["nccl_env"].items()},
            min_free_disk_gb=50.0,
        )
    except ValidationError as exc:
        raise OperatorError(f"stack {stack!r}: outputs do not make a valid cluster description:\n{exc}") from None


def pulumi_stack_outputs(stack: str, cwd: str | Path = REPO_ROOT, timeout: float = 60) -> dict[str, Any]:
    """`pulumi stack output --json --show-secrets --stack NAME` (the only boundary tests mock)."""
    cmd = ["pulumi", "stack", "output", "--json", "--show-secrets", "--stack", stack]
    if shutil.which("pulumi") is None:
        raise OperatorError("the pulumi CLI is not on PATH: install it (https://www.pulumi.com/docs/install/)")
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OperatorError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f}s") from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise OperatorError(f"cannot read outputs of stack {stack!r}: {' '.join(detail) or 'pulumi failed'}")
    try:
        outputs = json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        raise OperatorError(f"pulumi returned no JSON for stack {stack!r}") from None
    if not isinstance(outputs, dict) or not outputs:
        raise OperatorError(f"stack {stack!r} has no outputs (has `pulumi up` run?)")
    return outputs


def from_pulumi_stack(stack: str, ssh_key: str | Path, **kwargs: Any) -> ClusterDescription:
    cwd = kwargs.pop("cwd", REPO_ROOT)
    return from_stack_outputs(pulumi_stack_outputs(stack, cwd=cwd), stack, ssh_key, **kwargs)


def default_ssh_key() -> str:
    for name in ("id_ed25519", "id_rsa", "id_ecdsa"):
        candidate = Path.home() / ".ssh" / name
        if candidate.exists():
            return str(candidate)
    return str(Path.home() / ".ssh" / "id_ed25519")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    stack = sub.add_parser("from-stack", help="write a description from a Pulumi stack's outputs")
    stack.add_argument("--stack", required=True, help="Pulumi stack name")
    stack.add_argument("--ssh-key", default=default_ssh_key(), help="private key for the admin user")
    stack.add_argument("--runtime", choices=("docker", "host"), default="docker")
    stack.add_argument("--image-tag", default="latest", help="tag of the framework images (see build_images)")
    stack.add_argument("--known-hosts", help="known_hosts file for this cluster (default ~/.ssh/known_hosts.STACK)")
    stack.add_argument("-o", "--output", help="file to write (default cluster-STACK.json)")
    stack.add_argument("--cwd", default=str(REPO_ROOT), help="directory of the Pulumi project")
    show = sub.add_parser("show", help="print a description with its secrets masked")
    show.add_argument("--cluster", help="description file (default $CLUSTER_DESCRIPTION or the local cluster)")
    args = parser.parse_args(argv)

    def body() -> int:
        if args.command == "from-stack":
            desc = from_pulumi_stack(
                args.stack,
                args.ssh_key,
                cwd=args.cwd,
                known_hosts=args.known_hosts,
                runtime=args.runtime,
                image_tag=args.image_tag,
            )
            out = desc.save(args.output or f"cluster-{args.stack}.json")
            print(f"wrote {out} (mode 0600: it holds the read-only data SAS)")
        else:
            print(json.dumps(load(args.cluster).masked(), indent=2))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
