"""What the local cluster records in STATE_DIR/state.json: every machine, process, namespace and
port `up` created, so that `status` can show them and `down` can remove exactly them.

Three kinds of writers change the record: `up` and `down`, and the power programs slurmctld runs
(dtrain/local/power.py) when it stops and starts nodes. Each takes `state_lock` around its
read-modify-write, so that none loses another's processes.
"""

from __future__ import annotations

import fcntl
import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from dtrain.checks import describe_validation_error, read_json_file
from dtrain.errors import OperatorError
from dtrain.fileio import atomic_write
from dtrain.processes import matches

STATE_FILE = "state.json"
LOCK_FILE = "state.lock"


AZURITE_ACCOUNT = "devstoreaccount1"


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
    stopped: bool = False  # its sshd and slurmd were stopped on purpose (power saving, a failure test)


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
    storage_dir: str | None = None  # Azurite's blobs, when kept outside state_dir (`up --storage-dir`)
    ports: dict[str, int] = Field(default_factory=dict)  # jumpbox, nfs: sshd ports on 127.0.0.1
    slurm_conf: str | None = None  # SLURM_CONF for Slurm's commands on this machine (netns mode)
    link_rate: str | None = None  # each node's eth0 sends at most this (tc tbf); None: full speed
    node_link_rates: dict[str, str | None] = Field(default_factory=dict)  # one node's own (`link-rate --node`)
    gpus_per_node: int = 0  # emulated GPUs (dtrain/local/gpus.py)
    # What each node's Spot agent releases before the node is switched off (Lustre's stand-in); None: nothing
    release_mount: str | None = None
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def azurite_host(self) -> str:
        """Where Azurite listens. In netns mode, the bridge's address (the subnet's first), which the host
        and every node namespace reach: the jobs upload their results from the nodes."""
        if self.mode == "netns" and self.subnet:
            return str(next(ipaddress.ip_network(self.subnet).hosts()))
        return "127.0.0.1"

    @property
    def azurite_endpoint(self) -> str | None:
        """Azurite's account URL (None before it is started)."""
        return f"http://{self.azurite_host}:{self.azurite_port}/{AZURITE_ACCOUNT}" if self.azurite_port else None

    def save(self) -> None:
        """Write the record (callers that may race with another writer hold `state_lock`)."""
        atomic_write(Path(self.state_dir) / STATE_FILE, self.model_dump_json(indent=2))

    def hosts(self) -> list[HostState]:
        """Every machine with a namespace of its own: the head, then the nodes."""
        return [host for host in (self.head, *self.nodes) if host is not None and host.namespace]

    def node(self, hostname: str) -> NodeState:
        for node in self.nodes:
            if node.hostname == hostname:
                return node
        raise OperatorError(f"no node {hostname!r} in the local cluster {self.name!r}")

    def record(self, role: str) -> ProcessRecord | None:
        """The newest process recorded in that role."""
        return next((r for r in reversed(self.processes) if r.role == role), None)

    def add_process(self, record: ProcessRecord) -> None:
        """Record a process, in place of an earlier one in the same role (a node started again)."""
        roles = [r.role for r in self.processes]
        if record.role in roles:
            self.processes[roles.index(record.role)] = record
        else:
            self.processes.append(record)

    @property
    def logs(self) -> Path:
        return Path(self.state_dir) / "logs"

    @property
    def slurm_cluster_name(self) -> str:
        return self.name.lower()  # Slurm's names are lower case


def load_state(state_dir: Path) -> LocalState | None:
    if state_dir.exists() and not state_dir.is_dir():
        raise OperatorError(f"--state-dir {state_dir} is a file, not a directory")
    path = state_dir / STATE_FILE
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


@contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    """Hold the cluster's lock (an flock on STATE_DIR/state.lock, released when the holder exits,
    however it exits). Not reentrant: take it once per process."""
    with open(state_dir / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
