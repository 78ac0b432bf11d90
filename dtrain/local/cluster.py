"""The embedded local cluster: the Azure topology emulated on one machine, for demos and tests. Runs on the
operator's machine, as root; the `local` verb that starts and stops it is dtrain/cli/local.py.

  python -m dtrain local up [--nodes 2] [--autostop-seconds 0]   # writes STATE/cluster.json (~/.local/state/...)
  python -m dtrain local status
  python -m dtrain local link-rate 100mbit   # slow the links between nodes (tc tbf); `full` undoes it
  python -m dtrain local down

What `up` creates (all of it recorded in STATE_DIR/state.json, all of it removed by `down`):
  * nodes: one network namespace per node (`<name>-node-<i>`), a veth pair into it as eth0 on a
    bridge `<name>-br` with a private /24 (default 10.213.0.0/24, refused if anything on the
    machine already uses it), its own /etc/hosts (/etc/netns/<ns>/hosts) and its own sshd started
    under `unshare --uts` so that it has its own hostname (dtrain/local/nodes.py). Where
    namespaces cannot be made (no root, no CAP_NET_ADMIN), each node is an sshd on its own
    loopback address (127.0.1.x) and port, and there is no Slurm; `--link-rate` (or `local
    link-rate` later) slows each node's eth0 with tc (dtrain/local/link.py);
  * Slurm (namespaces only, started by dtrain/local/slurm.py): munged on the host, slurmctld in a head
    namespace (`<name>-head`) with slurmdbd and MariaDB beside it (dtrain/local/accounting.py: `sacct`),
    a slurmd on every node, with infra's slurm.conf; power saving
    (--autostop-seconds) stops and starts nodes (dtrain/local/power.py), and the health check
    drains a node that fails it;
  * a jump host and an "NFS server": two sshds on 127.0.0.1 ports (every SSH call goes through
    the jump host with ProxyJump, as on Azure);
  * the shared file system: STATE_DIR/shared (the same path on every node), with the dataset in
    shared/data, job files in shared/runs, the nodes' health reports in shared/.health;
  * blob storage: Azurite (from this repository's node_modules) on the bridge (127.0.0.1 in localhost
    mode), where the host and the nodes reach it, with `data` and
    `results` containers, a read-only SAS for `data` and a write SAS for `results`;
  * MLflow's tracking server in the head namespace (dtrain/local/mlflow_server.py), artifacts in Azurite;
  * a freshly generated SSH key (and host keys, pre-registered in a known_hosts file).
Processes are stopped by pid (with the descendants they forked), never by name.
"""

from __future__ import annotations

import contextlib
import getpass
import ipaddress
import os
import re
import shutil
import sys
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import SecretStr
from rich.table import Table

from dtrain.checks import ensure_directory, require_tool
from dtrain.cluster.description import (
    DEFAULT_LOCAL_STATE,
    REPO_ROOT,
    BlobCredential,
    BlobLocation,
    ClusterDescription,
    Runtime,
    SlurmAccess,
    SSHEndpoint,
    Telemetry,
)
from dtrain.errors import ExitCode, OperatorError
from dtrain.fileio import atomic_write
from dtrain.local import accounting as local_accounting
from dtrain.local import accounts as local_accounts
from dtrain.local import gpus as local_gpus
from dtrain.local import link as local_link
from dtrain.local import metadata as local_metadata
from dtrain.local import mlflow_server as local_mlflow
from dtrain.local import network as net
from dtrain.local import slurm as local_slurm
from dtrain.local import slurm_conf
from dtrain.local import telemetry as local_telemetry
from dtrain.local.daemons import free_port, wait_port
from dtrain.local.network import check_subnet_free
from dtrain.local.nodes import (
    SSHD,
    SYSTEM_PYTHON,
    enter_node,
    keygen,
    local_data_dir,
    node_roles,
    sshd_config,
    sshd_config_path,
    start_daemon,
    start_sshd,
    start_users_agent,
)
from dtrain.local.slurm_conf import LocalSlurmSettings
from dtrain.local.state import AZURITE_ACCOUNT, HostState, LocalState, NodeState, load_state, state_lock
from dtrain.processes import descendants, stop_pids
from dtrain.ui import make_console
from infra.cloud_init.accounting import MYSQL_PORT
from infra.contract import (
    HEALTH_REPORT_DIR,
    SLURM_PARTITION,
    SLURMCTLD_PORT,
    SLURMD_PORT,
    SLURMDBD_PORT,
    SPOT_PARTITION,
)
from infra.users import USERS_DIR

# Azurite's well-known development key (public, documented by Microsoft; not a secret).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_NAME = "hvd"
# `local up`'s --name and --subnet when not given: a second cluster beside the default one (a test
# running the documentation's `dtrain local up` as written, with XDG_STATE_HOME for its state).
NAME_ENV, SUBNET_ENV = "DTRAIN_LOCAL_NAME", "DTRAIN_LOCAL_SUBNET"
CLUSTER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,7}")  # it prefixes interface names (15 characters at most)
MAX_NODES = 32
MAX_HEALTH_CHECK_INTERVAL_S = 86400
TRAIN_PYTHON = REPO_ROOT / ".venv-train" / "bin" / "python"
SLURM_TOOLS = (f"{slurm_conf.SBIN}/munged", f"{slurm_conf.SBIN}/slurmctld", f"{slurm_conf.SBIN}/slurmd", "sinfo")
NO_SLURM_NOTE = "not run in localhost mode (each slurmd needs a network namespace of its own)"
LINK_RATE_NEEDS_NETNS = "a link rate needs nodes in network namespaces (--mode netns, as root)"
# The sshds on this machine's ports, and the host of the Azure cluster whose accounts each has: the jump
# host is also the Slurm login host here, which is Azure's head node.
SERVICE_HOSTS = {"jumpbox": local_accounts.LOGIN_HOST, "nfs": local_accounts.STORAGE_HOST}
console = make_console()


@dataclass(frozen=True)
class Storage:
    """Azurite, as the description hands it out."""

    endpoint: str
    connection_string: str
    data_sas: str
    results_sas: str


# --- up ----------------------------------------------------------------------------------------
def up(
    nodes: int = 2,
    state_dir: str | Path = DEFAULT_LOCAL_STATE,
    name: str = DEFAULT_NAME,
    subnet: str | ipaddress.IPv4Network = DEFAULT_SUBNET,
    mode: Literal["auto", "netns", "localhost"] = "auto",
    train_python: str | Path | None = None,
    autostop_seconds: int = 0,
    health_check_interval_s: int = 60,
    link_rate: str | None = None,
    gpus_per_node: int = 0,
    storage_dir: str | Path | None = None,
    release_mount: str | Path | None = None,
) -> ClusterDescription:
    """Create the local cluster and write STATE_DIR/cluster.json; on any failure remove what was made.

    autostop_seconds: idle seconds before Slurm suspends a node (0: never); health_check_interval_s:
    how often every node runs the health check; link_rate: what each node may send (`100mbit`; None
    or `full`: full speed); gpus_per_node: emulated GPUs (dtrain/local/gpus.py); storage_dir: where
    Azurite keeps the blobs (default: inside STATE_DIR, removed by `down`; elsewhere, they outlive the
    cluster, as Azure's storage does); release_mount: a path that every node's Spot agent releases (stops
    its writers, flushes, unmounts) before the node is switched off, as on an Azure stack with Lustre
    (dtrain/remote/boot/shared_release.py): whatever is mounted there inside a node stands in for the
    Lustre mount (None: nothing to release, the shared directory being no mount here)."""
    rate = local_link.parse_link_rate(link_rate) if link_rate else None
    state_dir = Path(state_dir).resolve()
    network = _check_up_request(nodes, state_dir, name, subnet)
    slurm = replace(_check_slurm_settings(autostop_seconds, health_check_interval_s), gpus_per_node=gpus_per_node)
    python = _training_python(train_python)
    mode = _resolve_mode(mode, name, autostop_seconds=autostop_seconds, rate=rate, gpus_per_node=gpus_per_node)
    azurite = _check_tools(mode)

    ensure_directory(state_dir, "--state-dir")
    # The state holds the cluster's SSH key and SASs: a state directory made inside a git checkout, under
    # any name, keeps itself out of commits (as a virtual environment does); `down` removes it with the rest.
    (state_dir / ".gitignore").write_text("*\n")
    if storage_dir is not None:
        storage_dir = Path(storage_dir).resolve()
        ensure_directory(storage_dir, "--storage-dir")
    if release_mount is not None:
        release_mount = Path(release_mount).resolve()
        ensure_directory(release_mount, "the release mount point")
    try:
        # held until the cluster is complete: the power programs slurmctld may start meanwhile wait
        with state_lock(state_dir):
            state = LocalState(
                name=name,
                mode=mode,
                state_dir=str(state_dir),
                link_rate=rate,
                gpus_per_node=gpus_per_node,
                storage_dir=str(storage_dir) if storage_dir else None,
                release_mount=str(release_mount) if release_mount else None,
            )
            state.save()
            return _up(state, nodes, network, azurite, python, slurm)
    except BaseException:
        console.print("[red]local cluster: up failed; removing what was created[/red]")
        down(state_dir, quiet=True)
        raise


def _resolve_mode(
    mode: Literal["auto", "netns", "localhost"],
    name: str,
    *,
    autostop_seconds: int,
    rate: str | None,
    gpus_per_node: int,
) -> Literal["netns", "localhost"]:
    """netns where namespaces can be made (auto), and the checks of what each mode cannot do: without
    namespaces there is no Slurm, hence no autostop nor emulated GPUs, and no per-node link to throttle."""
    if mode == "auto":
        mode = "netns" if net.netns_allowed(f"{name}-probe") else "localhost"
    elif mode == "netns" and not net.netns_allowed(f"{name}-probe"):
        raise OperatorError(
            "network namespaces cannot be created here (needs root); use --mode localhost", ExitCode.NOT_READY
        )
    if mode == "localhost" and autostop_seconds:
        raise OperatorError(f"--autostop-seconds needs Slurm, which is {NO_SLURM_NOTE}", ExitCode.NOT_READY)
    if mode == "localhost" and rate:
        raise OperatorError(LINK_RATE_NEEDS_NETNS, ExitCode.NOT_READY)
    if mode == "localhost" and gpus_per_node:
        raise OperatorError(f"--gpus-per-node needs Slurm, which is {NO_SLURM_NOTE}", ExitCode.NOT_READY)
    if rate:
        local_link.require_tc()
    if gpus_per_node:
        local_gpus.check_devices_cgroup()
    return mode


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
            f"a local cluster is already recorded in {state_dir} (run `dtrain local down "
            f"--state-dir {state_dir}` first)"
        )
    # `down` removes the whole state directory: never adopt one that holds anything else
    if state_dir.is_dir() and any(state_dir.iterdir()):
        raise OperatorError(f"--state-dir {state_dir} is not empty: pass a new or empty directory (down removes it)")
    return network


def _check_slurm_settings(autostop_seconds: int, health_check_interval_s: int) -> LocalSlurmSettings:
    if autostop_seconds < 0:
        raise OperatorError(f"--autostop-seconds must be 0 (never) or more, got {autostop_seconds}")
    if not 1 <= health_check_interval_s <= MAX_HEALTH_CHECK_INTERVAL_S:
        raise OperatorError(
            f"--health-check-interval must be between 1 and {MAX_HEALTH_CHECK_INTERVAL_S} seconds, "
            f"got {health_check_interval_s}"
        )
    return LocalSlurmSettings(autostop_s=autostop_seconds, health_check_interval_s=health_check_interval_s)


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
            require_tool(tool, "run tools/setup_system.sh (apt-get install munge slurmctld slurmd slurm-client)")
        for tool in local_accounting.TOOLS:
            require_tool(tool, local_accounting.INSTALL_HINT)
        local_telemetry.require_tools()
    azurite = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"
    if not azurite.exists():
        raise OperatorError(f"Azurite is not installed: run `npm ci` in {REPO_ROOT}", ExitCode.NOT_READY)
    return azurite


def _up(
    state: LocalState, count: int, subnet: ipaddress.IPv4Network, azurite: Path, python: Path, slurm: LocalSlurmSettings
) -> ClusterDescription:
    """Every step of `up`, each recording what it creates before creating it."""
    root = Path(state.state_dir)
    for sub in ("ssh", "hostkeys", "sshd", "logs", "shared/data", "shared/runs", "azurite"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # the daemons' logs are root's alone: a request URL, a key path or a job's environment may show there;
    # so are the blobs (the cluster's data, results and checkpoints)
    for private in ("logs", "azurite"):
        (root / private).chmod(0o700)
    # the nodes' health reports: root's, readable by every user (as cloud-init makes it on Azure)
    (root / "shared" / HEALTH_REPORT_DIR).mkdir(mode=0o755, exist_ok=True)
    # the users list and the hosts' reports of it: root's, readable by all (as head-setup makes it on Azure)
    (root / "shared" / USERS_DIR).mkdir(mode=0o755, exist_ok=True)
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
    if state.mode == "netns":
        # Slurm's configuration and accounting database come up while the sshds and Azurite start
        local_slurm.prepare(state, slurm)
    _wait_for_sshds_and_azurite(state)
    if state.mode == "netns":
        _start_users_agents(state)
    storage = _azurite_storage(str(state.azurite_endpoint))
    if state.mode == "netns":
        local_mlflow.start(state, storage.connection_string)  # not waited for: it comes up beside Slurm
        local_slurm.start(state)
        local_telemetry.start(state)
    desc = _describe(state, python, key, known_hosts, storage)
    desc.save(root / "cluster.json")
    return desc


def _wire_namespaces(state: LocalState, count: int, subnet: ipaddress.IPv4Network) -> None:
    """The bridge (the subnet's first address), the head namespace (second) and one per node (.10+i)."""
    check_subnet_free(subnet)
    addresses = list(subnet.hosts())
    bridge = f"{state.name}-br"
    head = HostState(
        hostname=slurm_conf.CONTROLLER_HOST,
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
        local_accounts.make_etc(state, host.hostname, hosts_text)
    local_accounts.make_etc(state, local_accounts.STORAGE_HOST)  # the NFS server: on this machine's network
    for node in nodes:
        local_link.set_rate(str(node.namespace), state.link_rate)
        _start_metadata_endpoint(state, node)


def set_link_rate(state_dir: str | Path, rate_text: str, node: str | None = None) -> str | None:
    """Change the running cluster's link rate (`100mbit`, or `full`), of every node or of ``node`` alone
    (a slow node among healthy ones); returns the rate now set."""
    rate = local_link.parse_link_rate(rate_text)
    state_dir = Path(state_dir).resolve()
    if load_state(state_dir) is None:
        raise OperatorError(f"no local cluster recorded in {state_dir}", ExitCode.NOT_READY)
    with state_lock(state_dir):
        state = load_state(state_dir)
        assert state is not None  # only `down` removes it, and it takes the lock
        if state.mode != "netns":
            raise OperatorError(LINK_RATE_NEEDS_NETNS, ExitCode.NOT_READY)
        names = [n.hostname for n in state.nodes]
        if node is not None and node not in names:
            raise OperatorError(f"no node {node!r} in this cluster: its nodes are {', '.join(names)}")
        local_link.require_tc()
        for each in state.nodes:
            if node in (None, each.hostname):
                local_link.set_rate(str(each.namespace), rate)
        if node is None:
            state.link_rate, state.node_link_rates = rate, {}
        else:
            state.node_link_rates[node] = rate
        state.save()
    return rate


def _start_metadata_endpoint(state: LocalState, node: NodeState) -> None:
    """Azure's instance metadata (Scheduled Events) at its own address, inside the node's namespace only."""
    namespace = str(node.namespace)
    net.sh("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{local_metadata.METADATA_ADDRESS}/32", "dev", "lo")
    module = [sys.executable, "-m", "dtrain.local.metadata", "--state-dir", state.state_dir, "serve", node.hostname]
    argv = ["ip", "netns", "exec", namespace, "env", f"PYTHONPATH={REPO_ROOT}", *module]
    start_daemon(state, f"metadata-{node.hostname}", argv, "dtrain.local.metadata")


def _loopback_nodes(state: LocalState, count: int) -> None:
    for i in range(count):
        address = f"127.0.1.{10 + i}"
        state.nodes.append(NodeState(hostname=f"node-{i}", address=address, ssh_port=free_port(address)))
    state.save()


def _start_sshds(state: LocalState, authorized: Path) -> list[str]:
    """An sshd per node, plus the jump host and the NFS server on loopback ports; returns the
    known_hosts lines for all of them."""
    root = Path(state.state_dir)
    with contextlib.suppress(OSError):  # sshd's privilege separation directory (root only)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    known_lines = []
    listeners = [(node.hostname, node.address, node.ssh_port) for node in state.nodes]
    for role in ("jumpbox", "nfs"):
        state.ports[role] = free_port()
        listeners.append((role, "127.0.0.1", state.ports[role]))
    admin = (getpass.getuser(), authorized)
    for role, address, port in listeners:
        host_key = root / "hostkeys" / role / "ssh_host_ed25519_key"
        known_lines.append(f"{_known_host(address, port)} {keygen(host_key, role)}")
        sshd_config(sshd_config_path(state, role), address, port, host_key, admin, "ERROR")
    for node in state.nodes:
        start_sshd(state, node)
    for role in SERVICE_HOSTS:
        cfg = sshd_config_path(state, role)
        argv = [SSHD, "-D", "-e", "-f", str(cfg)]
        if state.mode == "netns":  # with the accounts of the host it stands for (dtrain/local/accounts.py)
            etc = local_accounts.bind_etc(state, SERVICE_HOSTS[role])
            argv = ["unshare", "--mount", "--propagation", "slave", "sh", "-c", f'{etc} && exec "$@"', "sshd", *argv]
        start_daemon(state, role, argv, str(cfg))
    return known_lines


def _start_users_agents(state: LocalState) -> None:
    """On every host, the loop that applies the users list: the service hosts' in their sshd's mount
    namespace (where their /etc is, and their users' sessions), each node's inside the node."""
    for role, host in SERVICE_HOSTS.items():
        record = state.record(role)
        assert record is not None  # started by _start_sshds
        start_users_agent(state, host, ["nsenter", f"--target={record.pid}", "--mount"])
    for node in state.nodes:
        start_users_agent(state, node.hostname, enter_node(state, node))


def _start_azurite(state: LocalState, azurite: Path) -> None:
    state.azurite_port = free_port()
    location = Path(state.storage_dir or Path(state.state_dir) / "azurite")
    argv = [
        str(azurite),
        *("--blobHost", state.azurite_host, "--blobPort", str(state.azurite_port)),
        # --silent: no access log, whose every line would hold the request's full URL, SAS signature included
        *("--location", str(location), "--skipApiVersionCheck", "--silent"),
    ]
    # Azurite creates the blobs' files with its umask: private, as the storage account is.
    start_daemon(state, "azurite", argv, str(location), umask=0o077)


def _wait_for_sshds_and_azurite(state: LocalState) -> None:
    for node in state.nodes:
        wait_port(node.address, node.ssh_port, 20, f"sshd of {node.hostname}", state.logs / f"{node.hostname}.log")
    for role, port in state.ports.items():
        wait_port("127.0.0.1", port, 20, f"sshd of the {role}", state.logs / f"{role}.log")
    wait_port(state.azurite_host, state.azurite_port or 0, 60, "Azurite", state.logs / "azurite.log")


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
        gpus_per_node=state.gpus_per_node,
        node_cpus=slurm_conf.NODE_CPUS,  # its slurm.conf's CPUs= for every node
        node_ssh_port=22,
        shared_mount_path=str(shared),
        shared_is_mount=False,
        storage_export_path=str(shared),
        data_path=str(shared / "data"),
        local_data_path=str(local_data_dir(state)) if state.mode == "netns" else None,
        blob_pull=[SYSTEM_PYTHON, str(REPO_ROOT / "dtrain" / "remote" / "boot" / "blob_pull.py")],
        remote_python=SYSTEM_PYTHON,
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
        # jobs on the nodes write results with the same SAS (on Azure: the cluster's identity)
        results_upload=BlobCredential(kind="sas", secret=SecretStr(storage.results_sas)),
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
        default_time_limit=slurm_conf.JOB_TIME.default,  # as its slurm.conf says
        max_time_limit=slurm_conf.JOB_TIME.maximum,
        telemetry=Telemetry(prometheus_url=local_telemetry.prometheus_url(state)) if state.head else None,
        tracking_uri=local_mlflow.tracking_uri(state),
    )


def _slurm_access(state: LocalState, login: SSHEndpoint) -> SlurmAccess | None:
    """Slurm's facts for the description: its commands run on this machine (the jump host)."""
    if state.slurm_conf is None or state.head is None:
        return None
    return SlurmAccess(
        cluster_name=state.slurm_cluster_name,
        partition=SLURM_PARTITION,
        spot_partition=SPOT_PARTITION,
        controller_host=state.head.hostname,
        controller_address=state.head.address,
        login=login,
        conf=state.slurm_conf,
    )


def _known_host(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def _azurite_storage(endpoint: str) -> Storage:
    """The `data` and `results` containers, a read + list SAS for the first and a write SAS for the second."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

    conn_str = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    service = BlobServiceClient.from_connection_string(conn_str)
    for container in ("data", "results"):
        with contextlib.suppress(ResourceExistsError):  # kept from an earlier cluster (--storage-dir)
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
def _stop_processes(state: LocalState) -> list[int]:
    """Every recorded process with what it forked, then anything inside our namespaces. slurmctld goes
    first: until it is gone it may start a power program (which may start a node's sshd), and a
    power program still running, or waiting for the state lock, is its child and goes with it."""
    controller = [record for record in state.processes if record.role == "slurmctld"]
    stopped: set[int] = set()
    for records in (controller, [r for r in state.processes if r not in controller]):
        pids = [pid for record in records if record.alive() for pid in (record.pid, *descendants(record.pid))]
        stop_pids(sorted(set(pids) - stopped))
        stopped.update(pids)
    for _ in range(3):  # anything still inside our namespaces is ours (a node started meanwhile too)
        pids = [pid for host in state.hosts() for pid in net.namespace_pids(str(host.namespace))]
        if not pids:
            break
        stop_pids(sorted(set(pids)))
        stopped.update(pids)
    return sorted(stopped)


def down(state_dir: str | Path = DEFAULT_LOCAL_STATE, quiet: bool = False) -> bool:
    """Stop every recorded process (and what it forked), delete namespaces, links and files.

    Returns False when nothing was recorded there."""
    state_dir = Path(state_dir).resolve()
    if load_state(state_dir) is None:
        if not quiet:
            console.print(f"no local cluster recorded in {state_dir}")
        return False
    with state_lock(state_dir):  # no power program starts a node while it goes
        state = load_state(state_dir)
        assert state is not None  # only `down` removes it, and it holds the lock
        pids = _stop_processes(state)
        hosts = state.hosts()
        links = [str(h.veth) for h in hosts if h.veth] + ([state.bridge] if state.bridge else [])
        net.remove([str(h.namespace) for h in hosts], links, state.etc_netns)
        files = slurm_conf.SlurmFiles(state_dir)
        local_gpus.remove_cgroups(files, [node.hostname for node in state.nodes])
        runtime = files.runtime
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
        with contextlib.suppress(OSError):  # the runtime root, once no cluster uses it
            runtime.parent.rmdir()
    if not quiet:
        console.print(f"local cluster {state.name!r} removed ({len(set(pids))} processes stopped)")
    return True


# --- status ------------------------------------------------------------------------------------
def status(state_dir: str | Path = DEFAULT_LOCAL_STATE) -> dict:
    """What runs: every recorded process and namespace. A stopped node's daemons (power saving)
    show as stopped, and count as neither running nor failed; MLflow, alive but not answering yet
    (it comes up after `up` returns), as starting."""
    state_dir = Path(state_dir).resolve()
    state = load_state(state_dir)
    if state is None:
        return {"up": False, "state_dir": str(state_dir), "components": []}
    stopped_roles = {role for node in state.nodes if node.stopped for role in node_roles(node.hostname)}
    components = []
    tracking_uri = local_mlflow.tracking_uri(state)
    for record in state.processes:
        running = record.alive()
        condition = "running" if running else "stopped" if record.role in stopped_roles else "down"
        if running and record.role == local_mlflow.ROLE and tracking_uri:
            # alive, not answering yet: a job started now runs untracked
            condition = "running" if local_mlflow.wait_until_answers(tracking_uri, 0) else "starting"
        components.append({"component": record.role, "pid": record.pid if running else None, "state": condition})
    for host in state.hosts():
        exists = net.namespace_exists(str(host.namespace))
        components.append(
            {"component": f"netns {host.namespace}", "pid": None, "state": "running" if exists else "down"}
        )
    return {
        "up": bool(components) and all(c["state"] != "down" for c in components),
        "state_dir": str(state_dir),
        "mode": state.mode,
        "subnet": state.subnet,
        "nodes": [n.model_dump() for n in state.nodes],
        "ports": state.ports,
        "addresses": _addresses(state),
        "azurite": state.azurite_endpoint,
        "slurm_conf": state.slurm_conf,
        "link_rate": state.link_rate or local_link.FULL_SPEED,
        "node_link_rates": {node: rate or local_link.FULL_SPEED for node, rate in state.node_link_rates.items()},
        "description": str(state_dir / "cluster.json"),
        "components": components,
    }


def _addresses(state: LocalState) -> dict[str, str]:
    """component -> where it listens."""
    addresses = {n.hostname: f"{n.address}:{n.ssh_port}" for n in state.nodes}
    addresses.update({role: f"127.0.0.1:{port}" for role, port in state.ports.items()})
    if state.azurite_endpoint:
        addresses["azurite"] = state.azurite_endpoint
    if tracking_uri := local_mlflow.tracking_uri(state):
        addresses[local_mlflow.ROLE] = tracking_uri
    if state.slurm_conf and state.head:
        addresses["munged"] = str(slurm_conf.SlurmFiles(Path(state.state_dir)).munge_socket)
        addresses["slurmctld"] = f"{state.head.address}:{SLURMCTLD_PORT}"
        addresses[local_accounting.SLURMDBD_ROLE] = f"{state.head.address}:{SLURMDBD_PORT}"
        addresses[local_accounting.MARIADB_ROLE] = f"127.0.0.1:{MYSQL_PORT} in {state.head.namespace}"
        for n in state.nodes:
            addresses[slurm_conf.slurmd_role(n.hostname)] = f"{n.address}:{SLURMD_PORT}"
    return addresses


STATE_STYLE = {
    "running": "[green]running[/green]",
    "starting": "[yellow]starting[/yellow]",
    "stopped": "[yellow]stopped[/yellow]",
    "down": "[red]down[/red]",
}


def print_status(info: dict) -> None:
    out = make_console(stderr=False)
    if not info["components"]:
        out.print(f"no local cluster in {info['state_dir']}")
        return
    table = Table(title=f"local cluster ({info['mode']}, {info['state_dir']})")
    for col in ("component", "pid", "address", "state"):
        table.add_column(col)
    for c in info["components"]:
        address = info["addresses"].get(c["component"], "")
        table.add_row(c["component"], str(c["pid"] or "-"), address, STATE_STYLE[c["state"]])
    out.print(table)
    out.print(f"cluster description: {info['description']}")
    if info["mode"] == "netns":
        own = ", ".join(f"{node}: {rate}" for node, rate in info["node_link_rates"].items())
        out.print(f"link rate between nodes: {info['link_rate']}" + (f" ({own})" if own else ""))
    if info["slurm_conf"]:
        out.print(f"slurm: SLURM_CONF={info['slurm_conf']} sinfo (logs in {Path(info['state_dir']) / 'logs'})")
    else:
        out.print(f"slurm: {NO_SLURM_NOTE}")
    if any(c["state"] == "stopped" for c in info["components"]):
        out.print("stopped: nodes Slurm powered down (they start again when a job needs them)")
    if any(c["state"] == "starting" for c in info["components"]):
        out.print("starting: MLflow does not answer yet (10 to 50 s after `up`); a job started now runs untracked")
