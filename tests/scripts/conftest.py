"""Shared fixtures: one real local cluster (network namespaces, sshd, Slurm, Azurite) for the session.

Everything here is real: Azurite enforces SAS permissions, nodes are namespaces with their own sshd,
hostname and process table, Horovod runs across them over SSH. The only mocked boundary in the
suite is the Pulumi CLI (a stand-in executable on PATH, see fixtures/bin/pulumi).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from dtrain.cluster.description import ClusterDescription, load
from dtrain.errors import OperatorError
from dtrain.local import cluster as local_cluster
from dtrain.local import network as local_network
from dtrain.local import slurm_conf

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
JOB = "tests/scripts/fixtures/hvd_job.py"  # relative to the runtime workdir (the repository)
# Every cluster the suite creates gets its own name and a /24 nobody uses, apart from the demo's
# (hvd, 10.213.0.0/24), so that two test sessions on one machine do not collide.
_TAG = f"{os.getpid() % 100000:05d}"
_HANDED_OUT: set[str] = set()


def cluster_name(letter: str) -> str:
    return f"t{_TAG}{letter}"  # 7 characters: interface names stay within 15


# A /24 stays unused on the machine until its cluster is up: two sessions started at the same time
# (make test's lanes) would both see it free. Each claims it first with a file of its own.
_CLAIMS = Path(tempfile.gettempdir()) / "dtrain-test-subnets"


def free_subnet() -> str:
    for third in range(16, 251):
        subnet = f"10.213.{third}.0/24"
        if subnet in _HANDED_OUT or not _claim(third):
            continue
        try:
            local_network.check_subnet_free(ipaddress.ip_network(subnet))
        except OperatorError:
            continue
        _HANDED_OUT.add(subnet)
        return subnet
    raise RuntimeError("no free /24 in 10.213.16.0-10.213.250.0")


def _claim(third: int) -> bool:
    """Whether this session now holds the claim on 10.213.<third>.0/24 (it may take over the claim of
    a session that has ended)."""
    _CLAIMS.mkdir(mode=0o700, exist_ok=True)
    claim = _CLAIMS / str(third)
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                holder = int(claim.read_text() or 0)
            except (OSError, ValueError):
                return False  # being written by its claimant
            if holder == os.getpid() or Path(f"/proc/{holder}").exists():
                return False
            claim.unlink(missing_ok=True)  # its session has ended
            continue
        with os.fdopen(fd, "w") as out:
            out.write(str(os.getpid()))
        atexit.register(claim.unlink, missing_ok=True)
        return True
    return False


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


def start_module(module: str, *args: str, env: dict | None = None, interruptible: bool = False) -> subprocess.Popen:
    """``python -m module args`` in the background. interruptible: SIGINT is Ctrl-C in it, as in a
    terminal's foreground process, even where this test run was started in the background by a
    shell without job control, which makes its commands and their children ignore SIGINT."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        preexec_fn=_default_sigint if interruptible else None,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python then installs its KeyboardInterrupt handler


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


def local_state_dir(desc: ClusterDescription) -> Path:
    """The state directory of a local cluster, from its description (its shared directory is STATE/shared)."""
    return Path(desc.shared_mount_path).parent


def slurm_command(desc: ClusterDescription, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A Slurm command on this machine (the local cluster's login host), as the description says."""
    assert desc.slurm is not None and desc.slurm.conf
    env = {**os.environ, **slurm_conf.client_env(desc.slurm.conf)}
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def leftovers(state_dir: Path, name: str) -> list[str]:
    """What of a local cluster outlived `down`: namespaces and links named after it, processes
    naming its state directory (sshds, slurmds, slurmctld, munged, Azurite), its files."""
    found = [f"namespace {ns}" for ns in namespaces() if ns.startswith(f"{name}-")]
    found += [f"link {line.split(':')[1].strip()}" for line in links().splitlines() if f" {name}-" in line]
    found += [f"pid {pid}" for pid in live_pids_mentioning(str(state_dir.resolve()))]
    runtime = slurm_conf.SlurmFiles(state_dir).runtime  # the sockets' short directory under /run
    return found + [f"directory {d}" for d in (state_dir, runtime) if d.exists()]


@contextmanager
def own_cluster(tmp_path: Path, letter: str, nodes: int = 2, **up_kwargs: object) -> Iterator[ClusterDescription]:
    """A local cluster of the test's own (its own name and subnet), removed at the end, and checked
    to leave nothing behind."""
    state, name = tmp_path / f"cluster-{letter}", cluster_name(letter)
    desc = local_cluster.up(nodes=nodes, state_dir=state, name=name, subnet=free_subnet(), **up_kwargs)  # type: ignore[arg-type]
    try:
        yield desc
    finally:
        local_cluster.down(state, quiet=True)
    assert leftovers(state, name) == []


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
