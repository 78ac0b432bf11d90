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
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError
from rich.table import Table

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
    SSHEndpoint,
)
from scripts.errors import ExitCode, OperatorError
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
console = make_console()


class ProcessRecord(BaseModel):
    role: str
    pid: int
    marker: str  # a string in its command line: guards against a recycled pid


class NodeState(BaseModel):
    hostname: str
    address: str
    ssh_port: int
    namespace: str | None = None
    veth: str | None = None


class LocalState(BaseModel):
    name: str
    mode: Literal["netns", "localhost"]
    state_dir: str
    subnet: str | None = None
    bridge: str | None = None
    nodes: list[NodeState] = Field(default_factory=list)
    processes: list[ProcessRecord] = Field(default_factory=list)
    etc_netns: list[str] = Field(default_factory=list)
    azurite_port: int | None = None
    ports: dict[str, int] = Field(default_factory=dict)  # jumpbox, nfs: sshd ports on 127.0.0.1
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())

    def save(self) -> None:
        path = Path(self.state_dir) / "state.json"
        tmp = path.with_name("state.json.tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)


# --- helpers -----------------------------------------------------------------------------------
def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise OperatorError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}", ExitCode.FAILED)
    return proc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    tail = ""
    if log and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise OperatorError(
        f"{what} did not start listening on {host}:{port} within {timeout:.0f}s{tail}", ExitCode.TIMED_OUT
    )


def pid_alive(record: ProcessRecord) -> bool:
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return record.marker in cmdline


def descendants(pid: int) -> list[int]:
    """All live descendants of pid (children first found via /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_pids(pids: list[int], grace_s: float = 3.0) -> None:
    """TERM the given pids, wait, then KILL what is left."""
    live = [p for p in pids if Path(f"/proc/{p}").exists()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + grace_s
        while time.time() < deadline:
            live = [p for p in live if _running(p)]
            if not live:
                return
            time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":  # a zombie of ours: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


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


def netns_allowed(name: str) -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        return False
    probe = f"{name}-probe"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    sh("ip", "netns", "del", probe, check=False)
    return True


def check_subnet_free(subnet: ipaddress.IPv4Network) -> None:
    """Refuse a range that any interface or route on this machine already uses."""
    out = sh("ip", "-o", "-4", "addr", "show").stdout
    for line in out.splitlines():
        fields = line.split()
        cidr = fields[fields.index("inet") + 1]
        if ipaddress.ip_interface(cidr).network.overlaps(subnet):
            raise OperatorError(
                f"subnet {subnet} is already in use on this machine ({fields[1]} has {cidr}): pass another --subnet"
            )
    for line in sh("ip", "-4", "route", "show").stdout.splitlines():
        dest = line.split()[0]
        if dest != "default" and "/" in dest and ipaddress.ip_network(dest, strict=False).overlaps(subnet):
            raise OperatorError(
                f"subnet {subnet} overlaps the route {line.strip()!r} on this machine: pass another --subnet"
            )


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
    azurite = _check_tools()
    if mode == "auto":
        mode = "netns" if netns_allowed(name) else "localhost"
    elif mode == "netns" and not netns_allowed(name):
        raise OperatorError(
            "network namespaces cannot be created here (needs root); use --mode localhost", ExitCode.NOT_READY
        )

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


def _check_tools() -> Path:
    """The programs `up` runs; returns Azurite's launcher."""
    for tool in ("ssh", "ssh-keygen", SSHD, "node"):
        require_tool(tool, "apt-get install openssh-server openssh-client nodejs")
    azurite = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"
    if not azurite.exists():
        raise OperatorError(f"Azurite is not installed: run `npm ci` in {REPO_ROOT}", ExitCode.NOT_READY)
    return azurite


def _up(
    state: LocalState, count: int, subnet: ipaddress.IPv4Network, azurite: Path, python: Path
) -> ClusterDescription:
    root = Path(state.state_dir)
    user = getpass.getuser()
    for sub in ("ssh", "hostkeys", "sshd", "logs", "shared/nodes", "shared/data", "shared/runs", "azurite"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "ssh" / "id_ed25519"
    authorized = root / "ssh" / "authorized_keys"
    authorized.write_text(keygen(key, f"hvd-local-{state.name}") + "\n")
    known_hosts = root / "ssh" / "known_hosts"
    known_lines: list[str] = []
    with contextlib.suppress(OSError):  # sshd's privilege separation directory (root only)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)

    # node addresses and wiring
    if state.mode == "netns":
        check_subnet_free(subnet)
        hosts = list(subnet.hosts())
        gateway = hosts[0]
        state.subnet = str(subnet)
        state.bridge = f"{state.name}-br"
        if Path(f"/sys/class/net/{state.bridge}").exists():
            raise OperatorError(f"interface {state.bridge} already exists: another local cluster named {state.name}?")
        sh("ip", "link", "add", state.bridge, "type", "bridge")
        state.save()
        sh("ip", "addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", state.bridge)
        sh("ip", "link", "set", state.bridge, "up")
        for i in range(count):
            node = NodeState(
                hostname=f"node-{i}", address=str(hosts[9 + i]), ssh_port=22, namespace=f"{state.name}-node-{i}"
            )
            if sh("ip", "netns", "list").stdout.split().count(node.namespace):
                raise OperatorError(f"network namespace {node.namespace} already exists")
            sh("ip", "netns", "add", node.namespace)
            node.veth = f"{state.name}-v{i}"
            state.nodes.append(node)
            state.save()
            peer = f"{state.name}-p{i}"
            sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", peer)
            sh("ip", "link", "set", peer, "netns", node.namespace)
            sh("ip", "link", "set", node.veth, "master", state.bridge)
            sh("ip", "link", "set", node.veth, "up")
            nsx = ("ip", "netns", "exec", node.namespace)
            sh(*nsx, "ip", "link", "set", peer, "name", "eth0")
            sh(*nsx, "ip", "addr", "add", f"{node.address}/{subnet.prefixlen}", "dev", "eth0")
            sh(*nsx, "ip", "link", "set", "eth0", "up")
            sh(*nsx, "ip", "link", "set", "lo", "up")
        hosts_text = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{n.address}\t{n.hostname}\n" for n in state.nodes
        )
        for node in state.nodes:
            etc = Path("/etc/netns") / str(node.namespace)
            etc.mkdir(parents=True, exist_ok=True)
            state.etc_netns.append(str(etc))
            state.save()
            (etc / "hosts").write_text(hosts_text)
    else:
        for i in range(count):
            address = f"127.0.1.{10 + i}"
            state.nodes.append(NodeState(hostname=f"node-{i}", address=address, ssh_port=free_port(address)))
        state.save()

    # sshd per node, plus the jump host and the NFS server on loopback ports
    def start(role: str, argv: list[str], cfg: Path) -> None:
        log = root / "logs" / f"{role}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        state.processes.append(ProcessRecord(role=role, pid=proc.pid, marker=str(cfg)))
        state.save()

    for node in state.nodes:
        host_key = root / "hostkeys" / node.hostname / "ssh_host_ed25519_key"
        pub = keygen(host_key, node.hostname)
        known_lines.append(f"{_known_host(node.address, node.ssh_port)} {pub}")
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
        start(node.hostname, argv, cfg)
    ports = state.ports
    for role in ("jumpbox", "nfs"):
        port = ports[role] = free_port()
        host_key = root / "hostkeys" / role / "ssh_host_ed25519_key"
        known_lines.append(f"{_known_host('127.0.0.1', port)} {keygen(host_key, role)}")
        cfg = root / "sshd" / f"{role}.conf"
        sshd_config(cfg, "127.0.0.1", port, host_key, authorized, "ERROR")
        start(role, [SSHD, "-D", "-e", "-f", str(cfg)], cfg)
    atomic_write(known_hosts, "\n".join(known_lines) + "\n", 0o600)

    # Azurite
    state.azurite_port = free_port()
    location = root / "azurite"
    start(
        "azurite",
        [
            str(azurite),
            *("--blobHost", "127.0.0.1", "--blobPort", str(state.azurite_port)),
            *("--location", str(location), "--skipApiVersionCheck"),
        ],
        location,
    )
    for node in state.nodes:
        wait_port(node.address, node.ssh_port, 20, f"sshd of {node.hostname}", root / "logs" / f"{node.hostname}.log")
    for role, port in ports.items():
        wait_port("127.0.0.1", port, 20, f"sshd of the {role}", root / "logs" / f"{role}.log")
    wait_port("127.0.0.1", state.azurite_port, 60, "Azurite", root / "logs" / "azurite.log")
    endpoint = f"http://127.0.0.1:{state.azurite_port}/{AZURITE_ACCOUNT}"
    conn_str = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    data_sas, results_sas = _azurite_containers(conn_str)

    # the node registry, as cloud-init writes it on Azure once a node is ready
    shared = root / "shared"
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
        write_registry_record(shared / "nodes", record)

    desc = ClusterDescription(
        name=f"local-{state.name}",
        provider="local",
        ssh_user=user,
        ssh_key=str(key),
        known_hosts=str(known_hosts),
        jump_host=SSHEndpoint(host="127.0.0.1", port=ports["jumpbox"], user=user),
        storage_host=SSHEndpoint(host="127.0.0.1", port=ports["nfs"], user=user),
        node_count=count,
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
            endpoint=endpoint, container="data", credential=BlobCredential(kind="sas", secret=SecretStr(data_sas))
        ),
        staging_credential=BlobCredential(kind="connection_string", secret=SecretStr(conn_str)),
        results=BlobLocation(
            endpoint=endpoint,
            container="results",
            credential=BlobCredential(kind="sas", secret=SecretStr(results_sas)),
        ),
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
    desc.save(root / "cluster.json")
    return desc


def _known_host(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def _azurite_containers(conn_str: str) -> tuple[str, str]:
    from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

    service = BlobServiceClient.from_connection_string(conn_str)
    for container in ("data", "results"):
        service.create_container(container)
    expiry = datetime.now(UTC) + timedelta(days=7)

    def sas(container: str, permission: ContainerSasPermissions) -> str:
        return generate_container_sas(
            AZURITE_ACCOUNT, container, account_key=AZURITE_KEY, permission=permission, expiry=expiry,
            protocol="https,http",
        )  # fmt: skip

    return (
        sas("data", ContainerSasPermissions(read=True, list=True)),
        sas("results", ContainerSasPermissions(read=True, add=True, create=True, write=True, list=True)),
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
        if pid_alive(record):
            pids += [record.pid, *descendants(record.pid)]
    for node in state.nodes:  # anything still inside our namespaces is ours
        if node.namespace and Path(f"/run/netns/{node.namespace}").exists():
            out = sh("ip", "netns", "pids", node.namespace, check=False).stdout.split()
            pids += [int(p) for p in out if p.isdigit()]
    kill_pids(sorted(set(pids)))
    for node in state.nodes:
        if node.namespace:
            sh("ip", "netns", "del", node.namespace, check=False)
        if node.veth and Path(f"/sys/class/net/{node.veth}").exists():
            sh("ip", "link", "del", node.veth, check=False)
    if state.bridge and Path(f"/sys/class/net/{state.bridge}").exists():
        sh("ip", "link", "del", state.bridge, check=False)
    for etc in state.etc_netns:
        shutil.rmtree(etc, ignore_errors=True)
    if state.etc_netns:
        with contextlib.suppress(OSError):  # only when empty: other clusters may be using it
            Path("/etc/netns").rmdir()
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
        components.append({"component": record.role, "pid": record.pid, "running": pid_alive(record)})
    for node in state.nodes:
        if node.namespace:
            exists = Path(f"/run/netns/{node.namespace}").exists()
            components.append({"component": f"netns {node.namespace}", "pid": None, "running": exists})
    return {
        "up": all(c["running"] for c in components) and bool(components),
        "state_dir": str(state_dir),
        "mode": state.mode,
        "subnet": state.subnet,
        "nodes": [n.model_dump() for n in state.nodes],
        "ports": state.ports,
        "azurite": f"http://127.0.0.1:{state.azurite_port}/{AZURITE_ACCOUNT}" if state.azurite_port else None,
        "description": str(state_dir / "cluster.json"),
        "components": components,
    }


def print_status(info: dict) -> None:
    out = make_console(stderr=False)
    if not info["components"]:
        out.print(f"no local cluster in {info['state_dir']}")
        return
    table = Table(title=f"local cluster ({info['mode']}, {info['state_dir']})")
    for col in ("component", "pid", "address", "state"):
        table.add_column(col)
    addresses = {n["hostname"]: f"{n['address']}:{n['ssh_port']}" for n in info["nodes"]}
    addresses.update({role: f"127.0.0.1:{port}" for role, port in info.get("ports", {}).items()})
    for c in info["components"]:
        role = c["component"]
        table.add_row(
            role,
            str(c["pid"] or "-"),
            addresses.get(role, info["azurite"] if role == "azurite" else ""),
            "[green]running[/green]" if c["running"] else "[red]down[/red]",
        )
    out.print(table)
    out.print(f"cluster description: {info['description']}")


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="python -m scripts.local_cluster",
        description="Embedded local cluster: nodes as network namespaces with sshd, Azurite as blob storage.",
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
