"""The embedded local cluster: the Azure topology emulated on one machine, for demos and tests.

  python -m scripts.local_cluster up [--nodes 2]     # writes .local-cluster/cluster.json
  python -m scripts.local_cluster status
  python -m scripts.local_cluster down

What `up` creates (all of it recorded in STATE_DIR/state.json, all of it removed by `down`):
  * nodes: one network namespace per node (`<name>-node-<i>`), a veth pair into it as eth0 on a
    bridge `<name>-br` with a private /24 (default 10.213.0.0/24, refused if anything on the
    machine already uses it), its own /etc/hosts (/etc/netns/<ns>/hosts) and its own sshd started
    under `unshare --uts` so that it has its own hostname. Where namespaces cannot be made (no
    root, no CAP_NET_ADMIN), each node is an sshd on its own loopback address (127.0.1.x) and port;
  * Slurm (namespaces only, see scripts/local_slurm.py): munged on the host, slurmctld in a head
    namespace (`<name>-head`), a slurmd on every node, with infra's slurm.conf;
  * a jump host and an "NFS server": two sshds on 127.0.0.1 ports (every SSH call goes through
    the jump host with ProxyJump, as on Azure);
  * the shared file system: STATE_DIR/shared (the same path on every node), with the node
    registry in shared/nodes, the dataset in shared/data, job files in shared/runs;
  * blob storage: Azurite (from this repository's node_modules) on 127.0.0.1, with `data` and
    `results` containers, a read-only SAS for `data` and a write SAS for `results`;
  * a freshly generated SSH key (and host keys, pre-registered in a known_hosts file).
Processes are stopped by pid (with the descendants they forked), never by name.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError
from rich.table import Table

from infra.contract import SLURM_PARTITION, SLURMCTLD_PORT, SLURMD_PORT
from scripts import local_network as net
from scripts import local_slurm
from scripts.cli import (
    CLIParser,
    arg_type,
    describe_validation_error,
    ensure_directory,
    int_between,
    non_empty,
    read_json_file,
    require_tool,
    run_cli,
)
from scripts.cluster import (
    DEFAULT_LOCAL_STATE,
    REPO_ROOT,
    BlobCredential,
    BlobLocation,
    ClusterDescription,
    NodeRecord,
    Runtime,
    SlurmAccess,
    SSHEndpoint,
)
from scripts.daemons import free_port, wait_port, wait_socket_file
from scripts.errors import ExitCode, OperatorError
from scripts.fileio import atomic_write
from scripts.local_network import check_subnet_free, sh
from scripts.processes import children, descendants, matches, stop_pids
from scripts.ui import make_console

AZURITE_ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft; not a secret).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_NAME = "hvd"
CLUSTER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,7}")  # it prefixes interface names (15 characters at most)
MAX_NODES = 32
SSHD = "/usr/sbin/sshd"
# The NFS server runs blob-pull with the system python (as on Azure): proves it needs only the stdlib.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
TRAIN_PYTHON = REPO_ROOT / ".venv-train" / "bin" / "python"
SLURM_TOOLS = (f"{local_slurm.SBIN}/munged", f"{local_slurm.SBIN}/slurmctld", f"{local_slurm.SBIN}/slurmd", "sinfo")
SLURM_READY_TIMEOUT_S = 60
NO_SLURM_NOTE = "not run in localhost mode (each slurmd needs a network namespace of its own)"
console = make_console()


class ProcessRecord(BaseModel):
    role: str
    pid: int
    marker: str  # a string in its command line: guards against a recycled pid

    def alive(self) -> bool:
        return matches(self.pid, self.marker)


class HostState(BaseModel):
    """A machine of the cluster: its name, and in netns mode its namespace and veth on the bridge."""

    hostname: str
    address: str
    namespace: str | None = None
    veth: str | None = None


class NodeState(HostState):
    ssh_port: int


class LocalState(BaseModel):
    name: str
    mode: Literal["netns", "localhost"]
    state_dir: str
    subnet: str | None = None
    bridge: str | None = None
    head: HostState | None = None  # slurmctld's namespace (netns mode)
    nodes: list[NodeState] = Field(default_factory=list)
    processes: list[ProcessRecord] = Field(default_factory=list)
    etc_netns: list[str] = Field(default_factory=list)
    azurite_port: int | None = None
    ports: dict[str, int] = Field(default_factory=dict)  # jumpbox, nfs: sshd ports on 127.0.0.1
    slurm_conf: str | None = None  # SLURM_CONF for Slurm's commands on this machine (netns mode)
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())

    def save(self) -> None:
        atomic_write(Path(self.state_dir) / "state.json", self.model_dump_json(indent=2))

    def hosts(self) -> list[HostState]:
        """Every machine with a namespace of its own: the head, then the nodes."""
        return [host for host in (self.head, *self.nodes) if host is not None and host.namespace]

    @property
    def logs(self) -> Path:
        return Path(self.state_dir) / "logs"

    @property
    def slurm_cluster_name(self) -> str:
        return self.name.lower()  # Slurm's names are lower case


@dataclass(frozen=True)
class Storage:
    """Azurite, as the description hands it out."""

    endpoint: str
    connection_string: str
    data_sas: str
    results_sas: str


# --- helpers -----------------------------------------------------------------------------------
def write_registry_record(registry: Path, record: NodeRecord) -> Path:
    """The node registry format cloud-init writes on Azure: <dir>/<hostname>.json, atomically."""
    registry.mkdir(parents=True, exist_ok=True)
    data = record.model_dump(mode="json", exclude_none=True)
    path = registry / f"{record.hostname}.json"
    atomic_write(path, json.dumps(data) + "\n")
    return path


def load_state(state_dir: Path) -> LocalState | None:
    if state_dir.exists() and not state_dir.is_dir():
        raise OperatorError(f"--state-dir {state_dir} is a file, not a directory")
    path = state_dir / "state.json"
    if not path.exists():
        return None
    data = read_json_file(path, "local cluster state")
    try:
        return LocalState.model_validate(data)
    except ValidationError as exc:
        raise OperatorError(
            f"invalid local cluster state {path}: {describe_validation_error(exc)} (if nothing of that cluster "
            f"still runs, remove {state_dir})"
        ) from None


def sshd_config(path: Path, listen: str, port: int, host_key: Path, authorized_keys: Path, log_level: str) -> None:
    path.write_text(
        "\n".join(
            [
                f"ListenAddress {listen}",
                f"Port {port}",
                f"HostKey {host_key}",
                "PidFile none",
                f"AuthorizedKeysFile {authorized_keys}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "AllowTcpForwarding yes",
                "X11Forwarding no",
                "PrintMotd no",
                "PrintLastLog no",
                "MaxStartups 200",
                "MaxSessions 200",
                f"LogLevel {log_level}",
                "Subsystem sftp internal-sftp",
                "",
            ]
        )
    )


def keygen(path: Path, comment: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return path.with_name(path.name + ".pub").read_text().strip()


# --- up ----------------------------------------------------------------------------------------
def up(
    nodes: int = 2,
    state_dir: str | Path = DEFAULT_LOCAL_STATE,
    name: str = DEFAULT_NAME,
    subnet: str | ipaddress.IPv4Network = DEFAULT_SUBNET,
    mode: Literal["auto", "netns", "localhost"] = "auto",
    train_python: str | Path | None = None,
) -> ClusterDescription:
    """Create the local cluster and write STATE_DIR/cluster.json; on any failure remove what was made."""
    state_dir = Path(state_dir).resolve()
    network = _check_up_request(nodes, state_dir, name, subnet)
    python = _training_python(train_python)
    if mode == "auto":
        mode = "netns" if net.netns_allowed(f"{name}-probe") else "localhost"
    elif mode == "netns" and not net.netns_allowed(f"{name}-probe"):
        raise OperatorError(
            "network namespaces cannot be created here (needs root); use --mode localhost", ExitCode.NOT_READY
        )
    azurite = _check_tools(mode)

    ensure_directory(state_dir, "--state-dir")
    state = LocalState(name=name, mode=mode, state_dir=str(state_dir))
    state.save()
    try:
        return _up(state, nodes, network, azurite, python)
    except BaseException:
        console.print("[red]local cluster: up failed; removing what was created[/red]")
        down(state_dir, quiet=True)
        raise


def check_name(name: str) -> str:
    if not CLUSTER_NAME.fullmatch(name):
        raise OperatorError(
            f"invalid cluster name {name!r}: 1-8 letters and digits, starting with a letter (it prefixes interfaces)"
        )
    return name


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    """The nodes' range: a private IPv4 network, /28 or larger (public addresses would shadow real hosts)."""
    try:
        subnet = ipaddress.ip_network(text.strip())
    except ValueError as exc:
        raise OperatorError(f"invalid subnet {text!r}: {exc} (expected a range such as {DEFAULT_SUBNET})") from None
    if not isinstance(subnet, ipaddress.IPv4Network) or not subnet.is_private:
        raise OperatorError(f"subnet {text} is not a private IPv4 range (such as {DEFAULT_SUBNET})")
    if subnet.prefixlen > 28:
        raise OperatorError(f"subnet {subnet} is too small: use a /28 or larger")
    return subnet


def _check_up_request(
    nodes: int, state_dir: Path, name: str, subnet: str | ipaddress.IPv4Network
) -> ipaddress.IPv4Network:
    """The operator's choices, checked before anything is created; returns the parsed subnet."""
    if not 1 <= nodes <= MAX_NODES:
        raise OperatorError(f"--nodes must be between 1 and {MAX_NODES}")
    check_name(name)
    network = parse_subnet(str(subnet))
    if network.num_addresses < nodes + 12:
        raise OperatorError(f"subnet {network} is too small for {nodes} nodes")
    if load_state(state_dir) is not None:
        raise OperatorError(
            f"a local cluster is already recorded in {state_dir} (run `python -m scripts.local_cluster down "
            f"--state-dir {state_dir}` first)"
        )
    # `down` removes the whole state directory: never adopt one that holds anything else
    if state_dir.is_dir() and any(state_dir.iterdir()):
        raise OperatorError(f"--state-dir {state_dir} is not empty: pass a new or empty directory (down removes it)")
    return network


def _training_python(train_python: str | Path | None) -> Path:
    if train_python:
        python = Path(train_python)
        if not (python.is_file() and os.access(python, os.X_OK)):
            raise OperatorError(f"--train-python {python} is not an executable file")
        return python
    if not TRAIN_PYTHON.exists():
        raise OperatorError(
            f"training environment not found at {TRAIN_PYTHON}: run `make setup`, or pass --train-python",
            ExitCode.NOT_READY,
        )
    return TRAIN_PYTHON


def _check_tools(mode: str) -> Path:
    """The programs `up` runs; returns Azurite's launcher."""
    for tool in ("ssh", "ssh-keygen", SSHD, "node"):
        require_tool(tool, "apt-get install openssh-server openssh-client nodejs")
    if mode == "netns":
        for tool in (*SLURM_TOOLS, "nsenter"):
            require_tool(tool, "run scripts/setup_system.sh (apt-get install munge slurmctld slurmd slurm-client)")
    azurite = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"
    if not azurite.exists():
        raise OperatorError(f"Azurite is not installed: run `npm ci` in {REPO_ROOT}", ExitCode.NOT_READY)
    return azurite


def _up(
    state: LocalState, count: int, subnet: ipaddress.IPv4Network, azurite: Path, python: Path
) -> ClusterDescription:
    """Every step of `up`, each recording what it creates before creating it."""
    root = Path(state.state_dir)
    for sub in ("ssh", "hostkeys", "sshd", "logs", "shared/nodes", "shared/data", "shared/runs", "azurite"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "ssh" / "id_ed25519"
    authorized = root / "ssh" / "authorized_keys"
    authorized.write_text(keygen(key, f"hvd-local-{state.name}") + "\n")
    if state.mode == "netns":
        _wire_namespaces(state, count, subnet)
    else:
        _loopback_nodes(state, count)
    known_hosts = root / "ssh" / "known_hosts"
    atomic_write(known_hosts, "\n".join(_start_sshds(state, authorized)) + "\n", 0o600)
    _start_azurite(state, azurite)
    _wait_for_sshds_and_azurite(state)
    storage = _azurite_storage(state.azurite_port or 0)
    if state.mode == "netns":
        _start_slurm(state)
    _write_registry(state)
    desc = _describe(state, python, key, known_hosts, storage)
    desc.save(root / "cluster.json")
    return desc


def _wire_namespaces(state: LocalState, count: int, subnet: ipaddress.IPv4Network) -> None:
    """The bridge (the subnet's first address), the head namespace (second) and one per node (.10+i)."""
    check_subnet_free(subnet)
    addresses = list(subnet.hosts())
    bridge = f"{state.name}-br"
    head = HostState(
        hostname=local_slurm.CONTROLLER_HOST,
        address=str(addresses[1]),
        namespace=f"{state.name}-head",
        veth=f"{state.name}-vh",
    )
    nodes = [
        NodeState(
            hostname=f"node-{i}",
            address=str(addresses[9 + i]),
            ssh_port=22,
            namespace=f"{state.name}-node-{i}",
            veth=f"{state.name}-v{i}",
        )
        for i in range(count)
    ]
    # refuse before recording: `down` deletes whatever is recorded
    if net.interface_exists(bridge):
        raise OperatorError(f"interface {bridge} already exists: another local cluster named {state.name}?")
    for host in (head, *nodes):
        if net.namespace_exists(str(host.namespace)):
            raise OperatorError(f"network namespace {host.namespace} already exists")
    state.subnet, state.bridge, state.head, state.nodes = str(subnet), bridge, head, nodes
    state.etc_netns = [str(net.etc_dir(str(host.namespace))) for host in state.hosts()]
    state.save()
    net.add_bridge(bridge, str(addresses[0]), subnet.prefixlen)
    hosts_text = net.hosts_file_text([(host.address, host.hostname) for host in (head, *nodes)])
    for host in state.hosts():
        net.add_namespace(str(host.namespace), str(host.veth), bridge, host.address, subnet.prefixlen)
        etc = net.etc_dir(str(host.namespace))
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_text)


def _loopback_nodes(state: LocalState, count: int) -> None:
    for i in range(count):
        address = f"127.0.1.{10 + i}"
        state.nodes.append(NodeState(hostname=f"node-{i}", address=address, ssh_port=free_port(address)))
    state.save()


def _start(state: LocalState, role: str, argv: list[str], marker: str) -> int:
    """Start a daemon in its own session, output to STATE/logs/<role>.log, and record its pid."""
    with open(state.logs / f"{role}.log", "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    state.processes.append(ProcessRecord(role=role, pid=proc.pid, marker=marker))
    state.save()
    return proc.pid


def _start_sshds(state: LocalState, authorized: Path) -> list[str]:
    """An sshd per node, plus the jump host and the NFS server on loopback ports; returns the
    known_hosts lines for all of them."""
    root = Path(state.state_dir)
    with contextlib.suppress(OSError):  # sshd's privilege separation directory (root only)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    known_lines = []
    for node in state.nodes:
        host_key = root / "hostkeys" / node.hostname / "ssh_host_ed25519_key"
        known_lines.append(f"{_known_host(node.address, node.ssh_port)} {keygen(host_key, node.hostname)}")
        cfg = root / "sshd" / f"{node.hostname}.conf"
        sshd_config(cfg, node.address, node.ssh_port, host_key, authorized, "ERROR")
        if state.mode == "netns":
            # own hostname (UTS) and own process table (PID + /proc): like a separate machine, `ps` on
            # a node shows only that node's processes; when its sshd stops, the kernel ends them all
            unshare = ["unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
            script = f'hostname {node.hostname} && exec {SSHD} -D -e -f "$0"'
            argv = ["ip", "netns", "exec", str(node.namespace), *unshare, "sh", "-c", script, str(cfg)]
        else:
            argv = [SSHD, "-D", "-e", "-f", str(cfg)]
        _start(state, node.hostname, argv, str(cfg))
    for role in ("jumpbox", "nfs"):
        port = state.ports[role] = free_port()
        host_key = root / "hostkeys" / role / "ssh_host_ed25519_key"
        known_lines.append(f"{_known_host('127.0.0.1', port)} {keygen(host_key, role)}")
        cfg = root / "sshd" / f"{role}.conf"
        sshd_config(cfg, "127.0.0.1", port, host_key, authorized, "ERROR")
        _start(state, role, [SSHD, "-D", "-e", "-f", str(cfg)], str(cfg))
    return known_lines


def _start_azurite(state: LocalState, azurite: Path) -> None:
    state.azurite_port = free_port()
    location = Path(state.state_dir) / "azurite"
    argv = [
        str(azurite),
        *("--blobHost", "127.0.0.1", "--blobPort", str(state.azurite_port)),
        *("--location", str(location), "--skipApiVersionCheck"),
    ]
    _start(state, "azurite", argv, str(location))


def _wait_for_sshds_and_azurite(state: LocalState) -> None:
    for node in state.nodes:
        wait_port(node.address, node.ssh_port, 20, f"sshd of {node.hostname}", state.logs / f"{node.hostname}.log")
    for role, port in state.ports.items():
        wait_port("127.0.0.1", port, 20, f"sshd of the {role}", state.logs / f"{role}.log")
    wait_port("127.0.0.1", state.azurite_port or 0, 60, "Azurite", state.logs / "azurite.log")


def _start_slurm(state: LocalState) -> None:
    """munged, slurmctld in the head namespace, a slurmd on every node; returns once all are idle."""
    files = local_slurm.SlurmFiles(Path(state.state_dir))
    head, names = state.head, [node.hostname for node in state.nodes]
    assert head is not None and head.namespace  # netns mode wires the head first
    files.make_dirs(names)
    local_slurm.write_config(files, state.slurm_cluster_name, head.address, names, Path(state.state_dir) / "shared")
    state.slurm_conf = str(files.conf)
    _start(state, "munged", local_slurm.munged_argv(files), str(files.munge_socket))
    wait_socket_file(files.munge_socket, 20, "munged", state.logs / "munged.log")
    _start(state, "slurmctld", local_slurm.slurmctld_argv(head.namespace, files.conf), str(files.conf))
    wait_port(head.address, SLURMCTLD_PORT, 30, "slurmctld", state.logs / "slurmctld.log")
    for node in state.nodes:
        argv = local_slurm.slurmd_argv(_node_init_pid(state, node), node.hostname, files.conf)
        _start(state, local_slurm.slurmd_role(node.hostname), argv, str(files.conf))
    local_slurm.wait_until_idle(files.conf, names, SLURM_READY_TIMEOUT_S, state.logs)


def _node_init_pid(state: LocalState, node: NodeState) -> int:
    """The first process inside a node's namespaces (its sshd): what slurmd joins."""
    record = next(r for r in state.processes if r.role == node.hostname)
    found = children(record.pid) if record.alive() else []
    if len(found) != 1:
        log = state.logs / f"{node.hostname}.log"
        raise OperatorError(f"the sshd of {node.hostname} is not running (see {log})", ExitCode.FAILED)
    return found[0]


def _write_registry(state: LocalState) -> None:
    """The node registry, as cloud-init writes it on Azure once a node is ready."""
    now = datetime.now(UTC).replace(microsecond=0)
    for node in state.nodes:
        record = NodeRecord(
            hostname=node.hostname,
            address=node.address,
            gpus=0,
            ib_state="absent",
            ready_at=now,
            ssh_port=node.ssh_port if state.mode == "localhost" else None,
        )
        write_registry_record(Path(state.state_dir) / "shared" / "nodes", record)


def _describe(state: LocalState, python: Path, key: Path, known_hosts: Path, storage: Storage) -> ClusterDescription:
    shared = Path(state.state_dir) / "shared"
    user = getpass.getuser()
    jump_host = SSHEndpoint(host="127.0.0.1", port=state.ports["jumpbox"], user=user)
    return ClusterDescription(
        name=f"local-{state.name}",
        provider="local",
        ssh_user=user,
        ssh_key=str(key),
        known_hosts=str(known_hosts),
        jump_host=jump_host,
        storage_host=SSHEndpoint(host="127.0.0.1", port=state.ports["nfs"], user=user),
        node_count=len(state.nodes),
        gpus_per_node=0,
        expected_hostnames=[n.hostname for n in state.nodes],
        node_ssh_port=22,
        shared_mount_path=str(shared),
        shared_is_mount=False,
        storage_export_path=str(shared),
        node_registry_path=str(shared / "nodes"),
        data_path=str(shared / "data"),
        blob_pull=[SYSTEM_PYTHON, str(REPO_ROOT / "scripts" / "blob_pull.py")],
        storage_python=SYSTEM_PYTHON,
        data=BlobLocation(
            endpoint=storage.endpoint,
            container="data",
            credential=BlobCredential(kind="sas", secret=SecretStr(storage.data_sas)),
        ),
        staging_credential=BlobCredential(kind="connection_string", secret=SecretStr(storage.connection_string)),
        results=BlobLocation(
            endpoint=storage.endpoint,
            container="results",
            credential=BlobCredential(kind="sas", secret=SecretStr(storage.results_sas)),
        ),
        slurm=_slurm_access(state, login=jump_host),
        runtime=Runtime(
            kind="host",
            python=str(python),
            workdir=str(REPO_ROOT),
            identity_file=str(key),
            network_interface="eth0" if state.mode == "netns" else "lo",
        ),
        nccl_env={},
        min_free_disk_gb=1.0,
    )


def _slurm_access(state: LocalState, login: SSHEndpoint) -> SlurmAccess | None:
    """Slurm's facts for the description: its commands run on this machine (the jump host)."""
    if state.slurm_conf is None or state.head is None:
        return None
    return SlurmAccess(
        cluster_name=state.slurm_cluster_name,
        partition=SLURM_PARTITION,
        controller_host=state.head.hostname,
        controller_address=state.head.address,
        login=login,
        conf=state.slurm_conf,
    )


def _known_host(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def _azurite_storage(port: int) -> Storage:
    """The `data` and `results` containers, a read + list SAS for the first and a write SAS for the second."""
    from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    conn_str = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    service = BlobServiceClient.from_connection_string(conn_str)
    for container in ("data", "results"):
        service.create_container(container)
    expiry = datetime.now(UTC) + timedelta(days=7)

    def sas(container: str, permission: ContainerSasPermissions) -> str:
        return generate_container_sas(
            AZURITE_ACCOUNT, container, account_key=AZURITE_KEY, permission=permission, expiry=expiry,
            protocol="https,http",
        )  # fmt: skip

    return Storage(
        endpoint=endpoint,
        connection_string=conn_str,
        data_sas=sas("data", ContainerSasPermissions(read=True, list=True)),
        results_sas=sas("results", ContainerSasPermissions(read=True, add=True, create=True, write=True, list=True)),
    )


# --- down --------------------------------------------------------------------------------------
def down(state_dir: str | Path = DEFAULT_LOCAL_STATE, quiet: bool = False, keep_files: bool = False) -> bool:
    """Stop every recorded process (and what it forked), delete namespaces, links and files.

    Returns False when nothing was recorded there."""
    state_dir = Path(state_dir).resolve()
    state = load_state(state_dir)
    if state is None:
        if not quiet:
            console.print(f"no local cluster recorded in {state_dir}")
        return False
    pids: list[int] = []
    for record in state.processes:
        if record.alive():
            pids += [record.pid, *descendants(record.pid)]
    for host in state.hosts():  # anything still inside our namespaces is ours
        pids += net.namespace_pids(str(host.namespace))
    stop_pids(sorted(set(pids)))
    hosts = state.hosts()
    links = [str(h.veth) for h in hosts if h.veth] + ([state.bridge] if state.bridge else [])
    net.remove([str(h.namespace) for h in hosts], links, state.etc_netns)
    if keep_files:
        (state_dir / "state.json").unlink(missing_ok=True)
    else:
        shutil.rmtree(state_dir, ignore_errors=True)
    if not quiet:
        console.print(f"local cluster {state.name!r} removed ({len(set(pids))} processes stopped)")
    return True


# --- status ------------------------------------------------------------------------------------
def status(state_dir: str | Path = DEFAULT_LOCAL_STATE) -> dict:
    state_dir = Path(state_dir).resolve()
    state = load_state(state_dir)
    if state is None:
        return {"up": False, "state_dir": str(state_dir), "components": []}
    components = []
    for record in state.processes:
        components.append({"component": record.role, "pid": record.pid, "running": record.alive()})
    for host in state.hosts():
        exists = net.namespace_exists(str(host.namespace))
        components.append({"component": f"netns {host.namespace}", "pid": None, "running": exists})
    return {
        "up": all(c["running"] for c in components) and bool(components),
        "state_dir": str(state_dir),
        "mode": state.mode,
        "subnet": state.subnet,
        "nodes": [n.model_dump() for n in state.nodes],
        "ports": state.ports,
        "addresses": _addresses(state),
        "azurite": f"http://127.0.0.1:{state.azurite_port}/{AZURITE_ACCOUNT}" if state.azurite_port else None,
        "slurm_conf": state.slurm_conf,
        "description": str(state_dir / "cluster.json"),
        "components": components,
    }


def _addresses(state: LocalState) -> dict[str, str]:
    """component -> where it listens."""
    addresses = {n.hostname: f"{n.address}:{n.ssh_port}" for n in state.nodes}
    addresses.update({role: f"127.0.0.1:{port}" for role, port in state.ports.items()})
    if state.azurite_port:
        addresses["azurite"] = f"http://127.0.0.1:{state.azurite_port}/{AZURITE_ACCOUNT}"
    if state.slurm_conf and state.head:
        addresses["munged"] = str(local_slurm.SlurmFiles(Path(state.state_dir)).munge_socket)
        addresses["slurmctld"] = f"{state.head.address}:{SLURMCTLD_PORT}"
        for n in state.nodes:
            addresses[local_slurm.slurmd_role(n.hostname)] = f"{n.address}:{SLURMD_PORT}"
    return addresses


def print_status(info: dict) -> None:
    out = make_console(stderr=False)
    if not info["components"]:
        out.print(f"no local cluster in {info['state_dir']}")
        return
    table = Table(title=f"local cluster ({info['mode']}, {info['state_dir']})")
    for col in ("component", "pid", "address", "state"):
        table.add_column(col)
    for c in info["components"]:
        table.add_row(
            c["component"],
            str(c["pid"] or "-"),
            info["addresses"].get(c["component"], ""),
            "[green]running[/green]" if c["running"] else "[red]down[/red]",
        )
    out.print(table)
    out.print(f"cluster description: {info['description']}")
    if info["slurm_conf"]:
        out.print(f"slurm: SLURM_CONF={info['slurm_conf']} sinfo (logs in {Path(info['state_dir']) / 'logs'})")
    else:
        out.print(f"slurm: {NO_SLURM_NOTE}")


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="python -m scripts.local_cluster",
        description="Embedded local cluster: nodes as network namespaces with sshd and slurmd, Azurite as blob "
        "storage.",
    )
    parser.add_argument(
        "--state-dir", type=non_empty, default=str(DEFAULT_LOCAL_STATE), help="where its state lives (%(default)s)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create the cluster and write STATE_DIR/cluster.json")
    p_up.add_argument("--nodes", type=int_between(1, MAX_NODES), default=2)
    p_up.add_argument(
        "--name",
        type=arg_type(check_name),
        default=DEFAULT_NAME,
        help="prefix of namespaces and interfaces (%(default)s)",
    )
    p_up.add_argument(
        "--subnet",
        type=arg_type(parse_subnet),
        default=DEFAULT_SUBNET,
        help="private range for the nodes (%(default)s)",
    )
    p_up.add_argument("--mode", choices=("auto", "netns", "localhost"), default="auto")
    p_up.add_argument(
        "--train-python", type=non_empty, help=f"python of the training environment (default {TRAIN_PYTHON})"
    )
    sub.add_parser("down", help="stop and remove everything `up` created")
    sub.add_parser("status", help="what is running (exit 0 when everything is up, 3 when not)")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "up":
        desc = up(args.nodes, args.state_dir, args.name, args.subnet, args.mode, args.train_python)
        where = Path(args.state_dir) / "cluster.json"
        console.print(f"local cluster up: {desc.node_count} nodes; description {where}")
        return 0
    if args.command == "down":
        down(args.state_dir)
        return 0
    info = status(args.state_dir)
    print_status(info)
    return 0 if info["up"] else ExitCode.NOT_READY


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
