"""`dtrain ui`: the cluster's web UIs on the operator's machine, through SSH tunnels to the Slurm login host
(through the jump host on Azure, as every SSH call), so that no UI port is ever open beyond the private
network. Runs on the operator's machine.

  * Prometheus: where the cluster description's telemetry says (the head node);
  * MLflow: where the cluster description's tracking_uri says (the head node's server);
  * TensorBoard: started for the session on the login host over every run's event files, where the cluster
    runs jobs with a Python of its own (the host runtime: the local cluster); with docker images (Azure)
    the event files come with `dtrain results RUN`.

One `ssh -N -L ...` carries every tunnel; each local port is a free one on 127.0.0.1 (only this user's
machine sees it). Every process it starts is stopped by pid at the end.
"""

from __future__ import annotations

import posixpath
import socket
import subprocess
import time
import urllib.parse
from dataclasses import dataclass

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.ssh import SSH, q
from dtrain.errors import ExitCode, OperatorError
from dtrain.processes import stop_pids
from infra.contract import RUNS_DIR

TUNNEL_WAIT_S = 20


@dataclass(frozen=True)
class Service:
    name: str
    host: str  # as the login host reaches it
    port: int


def services(desc: ClusterDescription, tensorboard_port: int | None) -> list[Service]:
    """What `ui` tunnels to, for this cluster."""
    if desc.slurm is None:
        raise OperatorError(f"the cluster {desc.name!r} has no head node (no Slurm): no UI to open", ExitCode.NOT_READY)
    found = [url_service("MLflow", desc.tracking_uri)] if desc.tracking_uri else []
    if tensorboard_port is not None:
        found.append(Service("TensorBoard", "127.0.0.1", tensorboard_port))
    if desc.telemetry is not None:
        found.append(url_service("Prometheus", desc.telemetry.prometheus_url))
    return found


def url_service(name: str, url: str) -> Service:
    """The service behind an http(s) URL, as the login host reaches it."""
    parts = urllib.parse.urlsplit(url)
    return Service(name, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))


def tensorboard_command(desc: ClusterDescription, port: int) -> str | None:
    """The login host's TensorBoard over every run (host runtime only: that Python has tensorboard)."""
    if desc.runtime.kind != "host":
        return None
    logdir = posixpath.join(desc.shared_mount_path, RUNS_DIR)
    return f"exec {q(desc.runtime.python)} -m tensorboard.main --logdir {q(logdir)} --host 127.0.0.1 --port {port}"


def free_remote_port(ssh: SSH) -> int:
    """A port nothing listens on, on the login host (for the session's TensorBoard)."""
    probe = "python3 -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])'"
    return int(ssh.run(ssh.login, probe, timeout=30).stdout.strip())


def open_tunnels(ssh: SSH, wanted: list[Service]) -> tuple[subprocess.Popen, dict[str, str]]:
    """One ssh carrying a local forward per service; returns it and service name -> local URL, once every
    local port accepts connections."""
    local = {service.name: free_port() for service in wanted}
    forwards = [arg for s in wanted for arg in ("-L", f"127.0.0.1:{local[s.name]}:{s.host}:{s.port}")]
    argv = [*session_ssh(ssh), "-N", "-o", "ExitOnForwardFailure=yes", *forwards, ssh.login.alias]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + TUNNEL_WAIT_S
    while not all(_listening(port) for port in local.values()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pids([proc.pid])
            why = (proc.stderr.read() if proc.stderr and proc.poll() is not None else "").strip()
            raise OperatorError(f"the SSH tunnels to {ssh.login.label} did not open: {why or 'no answer'}")
        time.sleep(0.1)
    return proc, {name: f"http://127.0.0.1:{port}/" for name, port in local.items()}


def session_ssh(ssh: SSH) -> list[str]:
    """ssh to the login host on a connection of its own, for as long as this session: not the shared one
    (ControlMaster), whose master would outlive us in the background and carry our forwards with it."""
    return ["ssh", "-F", str(ssh.config_path), "-o", "ControlMaster=no", "-o", "ControlPath=none"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
