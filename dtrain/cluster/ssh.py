"""SSH from the operator's machine to the cluster, through the jump host, with the system OpenSSH client.

Why OpenSSH through subprocess rather than paramiko/asyncssh: ProxyJump, known_hosts handling and
keep-alives come for free and behave exactly as they do for the operator by hand; horovodrun
itself drives OpenSSH between nodes, so one tool and one set of behaviours covers every hop;
streaming a remote command's output line by line is a pipe; and every process we start has a pid
we can stop. A generated ssh_config (one Host block per host: jump host, NFS server, Slurm login host,
and each node asked for) carries the user, key, known_hosts file and timeouts, so every call is
just `ssh -F CONFIG ALIAS CMD`. Calls to the Slurm login host share one connection (OpenSSH's
ControlMaster, with a socket in the private directory): following a job asks Slurm every 2 s.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dtrain.checks import require_tool
from dtrain.cluster.description import ClusterDescription, SSHEndpoint, check_private_key
from dtrain.errors import ExitCode, OperatorError
from dtrain.fileio import atomic_write

# A node's alias is its host name; '_' is in no host name, so these can never be taken for a node's.
JUMP_ALIAS = "jump_host"
STORAGE_ALIAS = "storage_host"
LOGIN_ALIAS = "login_host"
CONNECT_TIMEOUT_S = 10
CONTROL_PERSIST_S = 30  # how long the login host's shared connection outlives its last use
# RFC 1123 host names: a node's name goes into the ssh_config, so it must be nothing else
HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


@dataclass(frozen=True)
class Target:
    """Something we SSH to: an alias in the generated config plus a human label."""

    alias: str
    label: str


class SSHFailure(OperatorError):
    """ssh itself failed (exit 255): unreachable host, authentication, host key: the cluster is not ready."""

    def __init__(self, message: str, exit_code: int = ExitCode.NOT_READY):
        super().__init__(message, exit_code)


def _block(alias: str, endpoint: SSHEndpoint, jump: bool) -> list[str]:
    lines = [f"Host {alias}", f"    HostName {endpoint.host}", f"    Port {endpoint.port}", f"    User {endpoint.user}"]
    if jump:
        lines.append(f"    ProxyJump {JUMP_ALIAS}")
    return [*lines, ""]


class SSH:
    """Runs commands on the cluster's hosts. Writes its ssh_config to a private temporary directory.

    Targets: `jump` (the jump host), `storage` (what fills the shared file system: the NFS server, or the
    head node of a Lustre stack), `login` (where Slurm's commands run)
    and `node(hostname)`, all but the jump host reached through it. A node's name is resolved on the
    jump host (Azure's DNS knows the scale set's instances), unless `addresses` maps it to an address
    (the local cluster, whose node names only the nodes know)."""

    def __init__(
        self, desc: ClusterDescription, addresses: Mapping[str, str] | None = None, workdir: str | Path | None = None
    ):
        require_tool("ssh", "install the OpenSSH client (apt-get install openssh-client)")
        try:
            check_private_key(desc.ssh_key)
        except OperatorError as exc:
            raise OperatorError(f"the cluster description's ssh_key: {exc}", exc.exit_code) from None
        self.desc = desc
        self.addresses = dict(addresses or {})
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="hvd-ssh-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "ssh_config"
        self._nodes: list[str] = []  # the nodes that have a Host block, in the order asked for
        self._write_config()

    @property
    def _control_path(self) -> Path:
        return self.workdir / "login.mux"

    def close(self) -> None:
        if self._control_path.exists():  # the login host's shared connection: end it now, not when idle
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(
                    ["ssh", "-F", str(self.config_path), "-O", "exit", LOGIN_ALIAS],
                    capture_output=True,
                    timeout=CONNECT_TIMEOUT_S,
                )
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> SSH:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- configuration ---------------------------------------------------------------------------
    def _write_config(self) -> None:
        d = self.desc
        jump = d.jump_host is not None
        lines: list[str] = ["# generated by dtrain.cluster.ssh for cluster " + d.name, ""]
        if d.jump_host:
            lines += _block(JUMP_ALIAS, d.jump_host, jump=False)
        lines += _block(STORAGE_ALIAS, d.storage_host, jump)
        if d.slurm:
            # locally the login host is the jump host itself: no hop through itself
            login = _block(LOGIN_ALIAS, d.slurm.login, jump and d.slurm.login != d.jump_host)
            # Following a job asks Slurm every 2 s: one connection (through the jump host) carries every
            # call, instead of a new two-hop connection each time. A dropped one is made again by the next
            # call; close() ends it.
            lines += [*login[:-1], "    ControlMaster auto", f"    ControlPath {self._control_path}",
                      f"    ControlPersist {CONTROL_PERSIST_S}", ""]  # fmt: skip
        for hostname in self._nodes:
            address = self.addresses.get(hostname, hostname)
            lines += _block(hostname, SSHEndpoint(host=address, user=d.ssh_user, port=d.node_ssh_port), jump)
        lines += [
            "Host *",
            f"    User {d.ssh_user}",
            f"    IdentityFile {d.ssh_key}",
            "    IdentitiesOnly yes",
            "    BatchMode yes",
            "    PasswordAuthentication no",
            "    KbdInteractiveAuthentication no",
            "    StrictHostKeyChecking accept-new",
            f"    UserKnownHostsFile {d.known_hosts}",
            "    GlobalKnownHostsFile /dev/null",
            f"    ConnectTimeout {CONNECT_TIMEOUT_S}",
            "    ServerAliveInterval 5",
            "    ServerAliveCountMax 3",
            "    ControlMaster no",
            "    LogLevel ERROR",
            "",
        ]
        Path(d.known_hosts).parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: an ssh starting in another thread while a node is added reads one or the other
        atomic_write(self.config_path, "\n".join(lines), 0o600)

    # --- targets ---------------------------------------------------------------------------------
    @property
    def jump(self) -> Target:
        if self.desc.jump_host is None:
            raise OperatorError(f"the cluster description {self.desc.name!r} has no jump host")
        return Target(JUMP_ALIAS, f"jump host {endpoint_label(self.desc.jump_host)}")

    @property
    def storage(self) -> Target:
        return Target(STORAGE_ALIAS, f"{storage_role(self.desc)} {endpoint_label(self.desc.storage_host)}")

    @property
    def login(self) -> Target:
        if self.desc.slurm is None:
            raise OperatorError(
                f"the cluster {self.desc.name!r} has no Slurm (the local cluster's fallback mode): jobs cannot run "
                "there; bring the local cluster up with network namespaces (as root)",
                ExitCode.NOT_READY,
            )
        return Target(LOGIN_ALIAS, f"Slurm login host {endpoint_label(self.desc.slurm.login)}")

    def node(self, hostname: str) -> Target:
        """A node by its Slurm name. Ask for every node before running on several in parallel."""
        if not HOSTNAME.fullmatch(hostname):
            raise OperatorError(f"invalid node name {hostname!r}")
        if hostname not in self._nodes:
            self._nodes.append(hostname)
            self._write_config()
        address = self.addresses.get(hostname, hostname)
        return Target(hostname, f"node {hostname} ({self.desc.ssh_user}@{address})")

    def argv(self, target: Target, command: str) -> list[str]:
        return ["ssh", "-F", str(self.config_path), target.alias, command]

    # --- running ---------------------------------------------------------------------------------
    def run(
        self,
        target: Target,
        command: str,
        *,
        input: bytes | str | None = None,
        timeout: float = 120,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run a command; ssh failures (exit 255) raise SSHFailure with a clear reason."""
        text = not isinstance(input, bytes)
        try:
            proc = subprocess.run(
                self.argv(target, command),
                input=input,
                capture_output=True,
                text=text,
                timeout=timeout,
                stdin=subprocess.DEVNULL if input is None else None,
            )
        except subprocess.TimeoutExpired:
            raise SSHFailure(f"{target.label}: no answer within {timeout:.0f}s", ExitCode.TIMED_OUT) from None
        if proc.returncode == 255:
            stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
            raise SSHFailure(explain_ssh_failure(target.label, stderr, self.desc))
        if check and proc.returncode != 0:
            err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
            raise OperatorError(
                f"{target.label}: command failed (exit {proc.returncode}): {err.strip()[-800:]}", ExitCode.FAILED
            )
        return proc

    def popen(self, target: Target, command: str, **kwargs: object) -> subprocess.Popen:
        """Start a command with its output streamed back (stdout+stderr merged, line by line).

        The ssh client gets its own session so that a Ctrl-C in the terminal reaches only us:
        we decide the order of the clean-up."""
        return subprocess.Popen(
            self.argv(target, command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,  # type: ignore[arg-type]
        )

    def run_parallel(
        self,
        targets: Sequence[Target],
        command: str | Callable[[Target], str],
        *,
        timeout: float = 120,
        check: bool = False,
    ) -> dict[str, subprocess.CompletedProcess | OperatorError]:
        """Run on many targets at once; returns alias -> result or the error it raised."""
        results: dict[str, subprocess.CompletedProcess | OperatorError] = {}

        def one(target: Target) -> None:
            cmd = command(target) if callable(command) else command
            try:
                results[target.alias] = self.run(target, cmd, timeout=timeout, check=check)
            except OperatorError as exc:
                results[target.alias] = exc

        if targets:
            with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
                list(pool.map(one, targets))
        return results


def explain_ssh_failure(label: str, stderr: str, desc: ClusterDescription) -> str:
    text = " ".join(stderr.split())
    jump = desc.jump_host
    via = f" (through the jump host {jump.user}@{jump.host}:{jump.port})" if jump else ""
    if "Permission denied" in text:
        return (
            f"{label}: SSH authentication failed for user {desc.ssh_user!r} with key {desc.ssh_key}{via}: "
            "check the key and the user"
        )
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr or "Host key verification failed" in text:
        return (
            f"{label}: host key verification failed{via}; if the host was recreated, remove its old key "
            f"from {desc.known_hosts}"
        )
    if re.search(r"Could not resolve hostname|Name or service not known", text):
        return f"{label}: host name does not resolve{via}: {text[-300:]}"
    for pattern in ("Connection timed out", "Connection refused", "No route to host", "Network is unreachable"):
        if pattern in text:
            return f"{label}: unreachable ({pattern.lower()}){via}"
    if "Connection closed" in text or "kex_exchange_identification" in text or "UNKNOWN port" in text:
        return f"{label}: unreachable (connection closed){via}: {text[-300:]}"
    if not text:
        return f"{label}: ssh failed with no message{via} (timeout or dropped connection)"
    return f"{label}: ssh failed{via}: {text[-400:]}"


def q(value: object) -> str:
    return shlex.quote(str(value))


def as_root(command: str) -> str:
    """command as root on the remote host: itself where the SSH user is root (the local cluster), else
    through sudo, which never prompts (-n): the admin user has it on Azure, a person of the list does not."""
    return f'if [ "$(id -u)" = 0 ]; then {command}; else sudo -n {command}; fi'


def storage_role(desc: ClusterDescription) -> str:
    """What the description's storage host is, in words: the NFS server, or the head node (Lustre)."""
    return "head node (Lustre)" if desc.shared_storage == "lustre" else "NFS server"


def endpoint_label(endpoint: SSHEndpoint) -> str:
    return f"{endpoint.user}@{endpoint.host}:{endpoint.port}"
