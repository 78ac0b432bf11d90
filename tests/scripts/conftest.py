"""Shared fixtures: one real local cluster (network namespaces, sshd, Slurm, Azurite) for the session.

Everything here is real: Azurite enforces SAS permissions, nodes are namespaces with their own sshd,
hostname and process table, Horovod runs across them over SSH. The only mocked boundary in the
suite is the Pulumi CLI (a stand-in executable on PATH, see fixtures/bin/pulumi).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from scripts import local_cluster, local_network
from scripts.cluster import ClusterDescription, NodeRecord, load
from scripts.errors import OperatorError
from scripts.sshutil import SSH

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
JOB = "tests/scripts/fixtures/hvd_job.py"  # relative to the runtime workdir (the repository)
# Every cluster the suite creates gets its own name and a /24 nobody uses, apart from the demo's
# (hvd, 10.213.0.0/24), so that two test sessions on one machine do not collide.
_TAG = f"{os.getpid() % 100000:05d}"
_HANDED_OUT: set[str] = set()


def cluster_name(letter: str) -> str:
    return f"t{_TAG}{letter}"  # 7 characters: interface names stay within 15


def free_subnet() -> str:
    for third in range(16, 251):
        subnet = f"10.213.{third}.0/24"
        if subnet in _HANDED_OUT:
            continue
        try:
            local_network.check_subnet_free(ipaddress.ip_network(subnet))
        except OperatorError:
            continue
        _HANDED_OUT.add(subnet)
        return subnet
    raise RuntimeError("no free /24 in 10.213.16.0-10.213.250.0")


def address(subnet: str, host: int) -> str:
    return str(ipaddress.ip_network(subnet).network_address + host)


SESSION_NAME, SESSION_SUBNET = cluster_name("s"), free_subnet()


def run_module(
    module: str, *args: str, env: dict | None = None, timeout: float = 300, prefix: Sequence[str] = (), **kw
) -> subprocess.CompletedProcess:
    """Run `python -m <module> args` from the repository root, the way an operator would (prefix: a
    command that wraps it, such as unshare)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [*prefix, sys.executable, "-m", module, *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def private_key_file(directory: Path) -> Path:
    """A file that passes the private-key check (a regular file, mode 0600): enough for commands that
    check the key but never connect with it."""
    key = directory / "id_ed25519"
    key.write_text("not a real key\n")
    key.chmod(0o600)
    return key


def start_module(module: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


def host_pids_with(marker: str) -> list[int]:
    """Pids (host view) of every process whose environment holds marker (e.g. HVD_RUN_ID=<id>)."""
    found = []
    needle = marker.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if environ.startswith(needle) or b"\0" + needle in environ:
            found.append(int(entry.name))
    return found


def live_pids_mentioning(text: str) -> list[int]:
    """Processes (not zombies: theirs is empty) whose command line contains text."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(entry.name))
    return found


def node_pids_with(desc: ClusterDescription, marker: str) -> dict[str, int]:
    """On every node, over SSH, in that node's own process table: how many processes carry marker."""
    records = [
        NodeRecord.model_validate_json(p.read_text()) for p in sorted(Path(desc.node_registry_path).glob("*.json"))
    ]
    script = (
        f"n=0; for d in /proc/[0-9]*; do grep -qxzF '{marker}' \"$d/environ\" 2>/dev/null && n=$((n+1)); done; echo $n"
    )
    with SSH(desc, records) as ssh:
        results = ssh.run_parallel([ssh.node(r.hostname) for r in records], script, check=True)
    return {host: int(res.stdout.strip()) for host, res in results.items()}  # type: ignore[union-attr]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Staging caches (shards, MD5s) go to a temporary XDG_CACHE_HOME, here and in subprocesses."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(scope="session")
def cluster_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("cluster")
    local_cluster.up(nodes=2, state_dir=state, name=SESSION_NAME, subnet=SESSION_SUBNET)
    try:
        yield state
    finally:
        local_cluster.down(state, quiet=True)


@pytest.fixture
def cluster(cluster_dir: Path) -> ClusterDescription:
    return load(cluster_dir / "cluster.json")


@pytest.fixture
def cluster_file(cluster_dir: Path) -> Path:
    return cluster_dir / "cluster.json"
