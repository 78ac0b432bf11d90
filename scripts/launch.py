"""Launch a Horovod job on the cluster over SSH (through the jump host), stream it, collect results.

  python -m scripts.launch --framework pytorch --nodes 2 -- --model resnet50 --data synthetic --steps 100

Steps: wait until enough nodes are ready in the node registry (on the NFS server) -> preflight
every node in parallel (GPUs, InfiniBand, shared file system, dataset, image or runtime, free
disk) and print a table; unhealthy nodes are excluded, or the launch aborts with
--abort-on-unhealthy -> write the run's files (hostfile, SSH settings for horovodrun) to the
shared file system -> docker runtime: start one container per node (host network, IB devices,
shared mount, sshd for horovodrun) -> run horovodrun on the first node with slots = GPUs and the
SKU's NCCL environment -> stream every rank's output prefixed with rank and host -> on exit,
Ctrl-C, SIGTERM or any failure, stop every process of the run on every node (found by the run id
in their environment, or by removing the containers) -> save logs, metrics and run.json under
runs/<run-id>/ and upload them to the results container. The exit status is the job's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError
from rich.table import Table

from infra.contract import FRAMEWORKS
from scripts import blobs
from scripts.cli import (
    CLIParser,
    arg_type,
    check_directory,
    int_between,
    non_empty,
    non_negative_number,
    positive_number,
    run_cli,
)
from scripts.cluster import REPO_ROOT, ClusterDescription, NodeRecord, load
from scripts.errors import ExitCode, OperatorError
from scripts.processes import stop_process_group
from scripts.sshutil import SSH, SSHFailure, Target, q
from scripts.ui import make_console

console = make_console()
RUN_ENV = "HVD_RUN_ID"  # every process of a run carries it in its environment: that is how we find them
DEFAULT_RUNS_DIR = REPO_ROOT / "runs"
# A run id names a directory here and on the share, and a container: one plain path component.
RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,100}")
HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclass
class LaunchOptions:
    framework: str
    job_args: list[str] = field(default_factory=list)
    nodes: int | None = None  # default: the description's node_count
    gpus_per_node: int | None = None  # processes per node; default: GPUs per node (1 on CPU nodes)
    hosts: list[str] | None = None  # run on exactly these registry hostnames
    wait_timeout: float = 60.0
    abort_on_unhealthy: bool = False
    entrypoint: str | None = None  # default: python -m training.<framework>; a .py path or a module
    image: str | None = None  # docker runtime: override the framework's image
    runs_dir: Path = DEFAULT_RUNS_DIR
    run_id: str | None = None
    upload: bool = True
    job_timeout: float | None = None
    start_timeout: int = 120  # horovodrun --start-timeout


@dataclass
class PreflightResult:
    hostname: str
    address: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    gpus: int | None = None
    ib_state: str | None = None
    shared: str | None = None
    data: str | None = None
    runtime: str | None = None
    free_disk_gb: float | None = None


@dataclass
class RunResult:
    run_id: str
    exit_code: int
    run_dir: Path
    nodes: list[str]
    world_size: int
    failed_rank: int | None = None
    failed_host: str | None = None
    interrupted: bool = False
    metrics: dict | None = None
    results_url: str | None = None
    stray_processes: dict[str, int] = field(default_factory=dict)
    message: str = ""


class Terminated(BaseException):
    """SIGTERM/SIGHUP reached the launcher."""


# --- node registry -----------------------------------------------------------------------------
_READ_REGISTRY = r"""
import glob, json, os, sys
out = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        with open(path) as handle:
            out.append({"file": os.path.basename(path), "record": json.load(handle)})
    except (OSError, ValueError) as exc:
        out.append({"file": os.path.basename(path), "error": str(exc)})
print(json.dumps({"exists": os.path.isdir(sys.argv[1]), "entries": out}))
"""


def read_registry(desc: ClusterDescription, ssh: SSH) -> tuple[list[NodeRecord], list[str]]:
    """The node records on the NFS server (valid ones), and a note for each invalid file."""
    path = desc.on_storage_host(desc.node_registry_path)
    proc = ssh.run(ssh.storage, f"{q(desc.storage_python)} -c {q(_READ_REGISTRY)} {q(path)}", timeout=60)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise OperatorError(
            f"{ssh.storage.label}: reading the node registry gave no JSON: {proc.stdout.strip()[-300:]!r}",
            ExitCode.FAILED,
        ) from None
    if not data["exists"]:
        return [], [f"registry directory {path} does not exist on the NFS server"]
    records, notes = [], []
    for entry in data["entries"]:
        if "error" in entry:
            notes.append(f"{entry['file']}: unreadable ({entry['error']})")
            continue
        try:
            records.append(NodeRecord.model_validate(entry["record"]))
        except ValidationError as exc:
            notes.append(f"{entry['file']}: invalid record ({exc.errors()[0]['msg']})")
    return records, notes


def wait_for_nodes(
    desc: ClusterDescription,
    ssh: SSH,
    count: int,
    hosts: Sequence[str] | None = None,
    timeout: float = 60.0,
    poll: float = 3.0,
) -> list[NodeRecord]:
    """Wait until `count` nodes (or exactly `hosts`) are in the registry; name the missing on timeout.

    Returns the `hosts` records in that order, or every registered node (at least `count`) by hostname."""
    deadline = time.time() + timeout
    announced = False
    while True:
        records, notes = read_registry(desc, ssh)
        by_name = {r.hostname: r for r in records}
        if hosts:
            missing = [h for h in hosts if h not in by_name]
            if not missing:
                return [by_name[h] for h in hosts]
        else:
            if len(records) >= count:
                return sorted(records, key=lambda r: r.hostname)
            expected = desc.expected_hostnames
            missing = [h for h in expected if h not in by_name][: count - len(records)] if expected else []
        if time.time() >= deadline:
            found = ", ".join(sorted(by_name)) or "none"
            where = f"{desc.node_registry_path} (on the NFS server {desc.storage_host.host})"
            if hosts:
                what = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in the node registry {where}"
            elif missing:
                what = f"only {len(records)} of {count} nodes are ready in {where}; missing: {', '.join(missing)}"
            else:
                what = (
                    f"only {len(records)} of {count} nodes are ready in {where}; {count - len(records)} more "
                    "never registered (check the scale set instances and their cloud-init logs)"
                )
            extra = f"; invalid registry files: {'; '.join(notes)}" if notes else ""
            raise OperatorError(f"{what} (found: {found}; waited {timeout:.0f}s){extra}", ExitCode.TIMED_OUT)
        if not announced:
            console.print(f"waiting up to {timeout:.0f}s for {len(hosts) if hosts else count} ready nodes ...")
            announced = True
        time.sleep(min(poll, max(0.1, deadline - time.time())))


# --- preflight ---------------------------------------------------------------------------------
def _preflight_script(desc: ClusterDescription, data_dir: str | None, image: str | None) -> str:
    shared = q(desc.shared_mount_path)
    lines = [
        "export LC_ALL=C",
        "gpus=0; if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); fi",
        'echo "gpus=$gpus"',
        "ib=absent",
        'for f in /sys/class/infiniband/*/ports/*/state; do [ -e "$f" ] || continue; '
        'if grep -q ACTIVE "$f"; then ib=ACTIVE; break; else ib=DOWN; fi; done',
        'echo "ib=$ib"',
    ]
    if desc.shared_is_mount:
        lines.append(f"if mountpoint -q {shared}; then echo shared=mounted; else echo shared=not-mounted; fi")
    else:
        lines.append(f"if [ -d {shared} ] && [ -w {shared} ]; then echo shared=present; else echo shared=missing; fi")
    if data_dir:
        d = q(data_dir)
        lines.append(
            f'if [ -d {d}/train ] && [ -n "$(find {d}/train -type f -print -quit)" ]; then '
            f"echo data=present; else echo data=missing; fi"
        )
    else:
        lines.append("echo data=not-needed")
    if desc.runtime.kind == "docker":
        img = q(image or "")
        lines.append(
            f"if docker image inspect {img} >/dev/null 2>&1; then echo runtime=image-present; "
            f"elif timeout 900 docker pull -q {img} >/dev/null 2>&1; then echo runtime=image-pulled; "
            "else echo runtime=image-missing; fi"
        )
    else:
        py = q(desc.runtime.python)
        hvd = q(str(Path(desc.runtime.python).parent / "horovodrun"))
        lines.append(f"if [ -x {py} ] && [ -x {hvd} ]; then echo runtime=host-ok; else echo runtime=host-missing; fi")
    disk_path = "/var/lib/docker" if desc.runtime.kind == "docker" else desc.shared_mount_path
    lines.append(f'p={q(disk_path)}; [ -e "$p" ] || p=/; echo "free_kb=$(df -Pk "$p" | awk \'NR==2 {{print $4}}\')"')
    return "\n".join(lines)


def preflight(
    desc: ClusterDescription,
    ssh: SSH,
    nodes: Sequence[NodeRecord],
    *,
    data_dir: str | None = None,
    image: str | None = None,
    expected_gpus: int | None = None,
) -> list[PreflightResult]:
    """Check every node in parallel. A node that cannot be reached is a failed check, not a crash."""
    script = _preflight_script(desc, data_dir, image)
    targets = [ssh.node(n.hostname) for n in nodes]
    results = ssh.run_parallel(targets, f"sh -c {q(script)}", timeout=60)
    expected_gpus = desc.gpus_per_node if expected_gpus is None else expected_gpus
    out = []
    for node in nodes:
        res = results[node.hostname]
        item = PreflightResult(hostname=node.hostname, address=node.address, ok=True)
        if isinstance(res, OperatorError):
            item.ok = False
            item.problems.append(str(res).split(": ", 1)[-1] if isinstance(res, SSHFailure) else str(res))
            out.append(item)
            continue
        values = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
        item.gpus = int(values.get("gpus", "0") or 0)
        item.ib_state = values.get("ib")
        item.shared = values.get("shared")
        item.data = values.get("data")
        item.runtime = values.get("runtime")
        try:
            item.free_disk_gb = round(int(values.get("free_kb", "0")) / 1024 / 1024, 1)
        except ValueError:
            item.free_disk_gb = None
        if res.returncode != 0 or not values:
            item.problems.append(f"preflight script failed (exit {res.returncode}): {res.stderr.strip()[-200:]}")
        if item.gpus < expected_gpus:
            item.problems.append(f"{item.gpus} GPUs, expected {expected_gpus}")
        if desc.expect_infiniband and item.ib_state != "ACTIVE":
            item.problems.append(f"InfiniBand {item.ib_state}")
        if item.shared not in ("mounted", "present"):
            item.problems.append(f"shared file system {desc.shared_mount_path} {item.shared}")
        if item.data == "missing":
            item.problems.append(f"dataset {data_dir} missing or empty")
        if item.runtime in ("image-missing", "host-missing"):
            item.problems.append(
                f"image {image} not present and not pullable"
                if item.runtime == "image-missing"
                else f"training environment {desc.runtime.python} (with horovodrun) missing"
            )
        if item.free_disk_gb is not None and item.free_disk_gb < desc.min_free_disk_gb:
            item.problems.append(f"{item.free_disk_gb} GB free, need {desc.min_free_disk_gb:g}")
        item.ok = not item.problems
        out.append(item)
    return out


def preflight_table(results: Sequence[PreflightResult]) -> Table:
    table = Table(title="preflight")
    for col in ("node", "address", "GPUs", "IB", "shared FS", "data", "image/runtime", "free disk", "status"):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.hostname,
            r.address,
            "-" if r.gpus is None else str(r.gpus),
            r.ib_state or "-",
            r.shared or "-",
            r.data or "-",
            r.runtime or "-",
            "-" if r.free_disk_gb is None else f"{r.free_disk_gb:g} GB",
            "[green]ok[/green]" if r.ok else f"[red]{'; '.join(r.problems)}[/red]",
        )
    return table


# --- the job command ---------------------------------------------------------------------------
def rank_hosts(nodes: Sequence[NodeRecord], slots: int) -> list[str]:
    """Rank -> hostname, as horovodrun assigns them: host by host, `slots` ranks each, in hostfile order."""
    return [n.hostname for n in nodes for _ in range(slots)]


def hostfile_text(nodes: Sequence[NodeRecord], slots: int) -> str:
    return "".join(f"{n.address} slots={slots}\n" for n in nodes)


def ssh_files_for_horovodrun(
    desc: ClusterDescription, nodes: Sequence[NodeRecord], run_dir: str, run_key: str | None
) -> dict[str, tuple[str, int]]:
    """The SSH settings horovodrun uses between nodes, as files under <run_dir>/ssh: a config with one
    Host block per node address, and an `ssh` wrapper put first on PATH that applies it."""
    if desc.runtime.kind == "docker":
        identity, user = "/root/.ssh/hvd_run_key", "root"
    else:
        identity, user = desc.runtime.identity_file or "~/.ssh/id_ed25519", desc.ssh_user
    blocks = []
    for n in nodes:
        port = desc.runtime.ssh_port or n.ssh_port or desc.node_ssh_port
        blocks.append(f"Host {n.address} {n.hostname}\n    HostName {n.address}\n    Port {port}\n")
    config = (
        "".join(blocks) + "Host *\n"
        f"    User {user}\n"
        f"    IdentityFile {identity}\n"
        "    IdentitiesOnly yes\n"
        "    BatchMode yes\n"
        # run-scoped peers on a private network; the operator's hops are checked against known_hosts
        "    StrictHostKeyChecking no\n"
        "    UserKnownHostsFile /dev/null\n"
        "    ConnectTimeout 10\n"
        "    LogLevel ERROR\n"
    )
    wrapper = (
        "#!/bin/sh\n# ssh for horovodrun inside this run: the run's config, then the real client\n"
        "for c in /usr/bin/ssh /bin/ssh /usr/local/bin/ssh; do\n"
        f'  [ -x "$c" ] && exec "$c" -F {q(run_dir + "/ssh/config")} "$@"\n'
        "done\necho 'ssh client not found' >&2; exit 127\n"
    )
    files = {"ssh/config": (config, 0o644), "ssh/bin/ssh": (wrapper, 0o755)}
    if run_key is not None:  # docker: a key pair for this run only (container sshd <-> horovodrun)
        # Private: only the operator's user and root (each container) can read it on the share.
        files["ssh/id_ed25519"] = (run_key, 0o600)
    return files


def job_argv(desc: ClusterDescription, opts: LaunchOptions, metrics_path: str) -> list[str]:
    python = desc.runtime.python
    if opts.entrypoint:
        entry = [python, opts.entrypoint] if opts.entrypoint.endswith(".py") else [python, "-m", opts.entrypoint]
    else:
        entry = [python, "-m", f"training.{opts.framework}"]
    args = list(opts.job_args)
    if "--metrics-json" not in args and not any(a.startswith("--metrics-json=") for a in args):
        args += ["--metrics-json", metrics_path]
    return entry + args


def horovodrun_command(
    desc: ClusterDescription,
    opts: LaunchOptions,
    run_id: str,
    run_dir: str,
    world_size: int,
    metrics_path: str,
) -> str:
    """The shell command that runs horovodrun on the launch node (inside its container for docker)."""
    rt = desc.runtime
    hvdrun = "horovodrun" if rt.kind == "docker" else str(Path(rt.python).parent / "horovodrun")
    argv = [hvdrun, "--gloo", "-np", str(world_size), "--hostfile", f"{run_dir}/hostfile", "--disable-cache"]
    argv += ["--start-timeout", str(opts.start_timeout)]
    if rt.network_interface:
        argv += ["--network-interface", rt.network_interface]
    if rt.kind == "docker" and rt.ssh_port:
        argv += ["-p", str(rt.ssh_port)]
    argv += job_argv(desc, opts, metrics_path)
    env = {RUN_ENV: run_id, "PYTHONUNBUFFERED": "1", **desc.nccl_env}
    env_words = " ".join(f"{k}={q(v)}" for k, v in env.items())
    path = f"{q(run_dir + '/ssh/bin')}:{q(str(Path(rt.python).parent)) + ':' if rt.kind == 'host' else ''}$PATH"
    inner = f"cd {q(rt.workdir)} && exec env {env_words} PATH={path} {' '.join(q(a) for a in argv)}"
    if rt.kind == "docker":
        return f"docker exec -e {RUN_ENV}={q(run_id)} {container_name(run_id)} sh -c {q(inner)}"
    return inner


def container_name(run_id: str) -> str:
    return f"hvd-{run_id}"


def docker_run_command(desc: ClusterDescription, run_id: str, run_dir: str, image: str, gpus: bool) -> str:
    """Start this run's container on a node: host network and IPC, IB devices, shared mount, an sshd
    on the runtime's port that accepts only this run's key (horovodrun's transport between nodes)."""
    port = desc.runtime.ssh_port
    setup = (
        "mkdir -p /root/.ssh /run/sshd && "
        f"install -m 600 {q(run_dir + '/ssh/id_ed25519')} /root/.ssh/hvd_run_key && "
        f"install -m 600 {q(run_dir + '/ssh/host_ed25519')} /etc/ssh/hvd_host_key && "
        f"install -m 600 {q(run_dir + '/ssh/authorized_keys')} /root/.ssh/hvd_authorized_keys && "
        f"exec /usr/sbin/sshd -D -e -p {port} -o HostKey=/etc/ssh/hvd_host_key "
        "-o AuthorizedKeysFile=/root/.ssh/hvd_authorized_keys -o PermitRootLogin=prohibit-password "
        "-o PasswordAuthentication=no -o UsePAM=no -o StrictModes=no"
    )
    argv = ["docker", "run", "-d", "--name", container_name(run_id), "--label", f"hvd.run={run_id}"]
    argv += ["--network", "host", "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
    argv += ["--cap-add", "IPC_LOCK", "-e", f"{RUN_ENV}={run_id}"]
    if gpus:
        argv += ["--gpus", "all"]
    if desc.expect_infiniband:
        argv += ["--device", "/dev/infiniband"]
    argv += ["-v", f"{desc.shared_mount_path}:{desc.shared_mount_path}"]
    for k, v in desc.nccl_env.items():
        argv += ["-e", f"{k}={v}"]
    argv += [image, "sh", "-c", setup]
    return " ".join(q(a) for a in argv)


def sweep_command(desc: ClusterDescription, run_id: str) -> str:
    """Stop every process of the run on a node: remove its container (docker), or TERM then KILL each
    process whose environment carries HVD_RUN_ID=<run id> (host). Prints how many were found."""
    if desc.runtime.kind == "docker":
        name = container_name(run_id)
        return f"if docker rm -f {name} >/dev/null 2>&1; then echo stopped=1; else echo stopped=0; fi"
    marker = q(f"{RUN_ENV}={run_id}")
    return (
        'find_run() { for d in /proc/[0-9]*; do p=${d#/proc/}; [ "$p" = $$ ] && continue; '
        f'grep -qxzF {marker} "$d/environ" 2>/dev/null && echo "$p"; done; }}; '
        "first=$(find_run); n=$(echo $first | wc -w); "
        '[ -n "$first" ] && kill -TERM $first 2>/dev/null; '
        'for i in 1 2 3 4 5 6 7 8 9 10; do left=$(find_run); [ -z "$left" ] && break; sleep 0.3; done; '
        '[ -n "$left" ] && kill -KILL $left 2>/dev/null; sleep 0.2; '
        'echo "stopped=$n"; echo "left=$(find_run | wc -w)"'
    )


# --- output streaming --------------------------------------------------------------------------
_RANK_LINE = re.compile(r"^(?:[A-Z][a-z]{2} [A-Z][a-z]{2} +\d+ [\d:]+ \d{4})?\[(\d+)\]<(stdout|stderr)>:(.*)$")
_FAILED = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_FIRST_FAILED = re.compile(r"^Process name: (\d+)")
_FIRST_CODE = re.compile(r"^Exit code: (-?\d+)")


class Streamer:
    """Reads horovodrun's merged output, prefixes every rank's line with rank and host, writes logs."""

    def __init__(self, run_dir: Path, hosts_by_rank: list[str], echo: Callable[[str], None] | None = None):
        self.hosts = hosts_by_rank
        self.echo = echo or (lambda line: print(line, flush=True))
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.combined = open(run_dir / "launch.log", "a", buffering=1)  # noqa: SIM115 - closed in close()
        logs = run_dir / "logs"
        self.rank_logs = {r: open(logs / f"rank-{r}.log", "a", buffering=1) for r in range(len(hosts_by_rank))}  # noqa: SIM115
        self.failures: list[tuple[int, int]] = []  # (rank, exit code) in the order horovodrun reported them
        # The job's own verdict (training/job.py prints one `error:` line): it names the rank that
        # stopped answering, where horovodrun names the rank that exited first.
        self.job_error: str | None = None
        self.first_failure: tuple[int | None, int | None] = (None, None)
        self.in_traceback = False

    def feed(self, raw: str) -> None:
        line = raw.rstrip("\n")
        quiet = False
        m = _RANK_LINE.match(line)
        if m:
            rank, stream, text = int(m.group(1)), m.group(2), m.group(3)
            host = self.hosts[rank] if rank < len(self.hosts) else "?"
            out = f"[{rank}|{host}]{'!' if stream == 'stderr' else ''} {text}"
            if rank in self.rank_logs:
                self.rank_logs[rank].write(text + "\n")
            if self.job_error is None and text.startswith("error: "):
                self.job_error = text.removeprefix("error: ")
        else:
            out = f"[horovodrun] {line}"
            # horovodrun ends a failed job with its own Python traceback: keep it in the log only
            if line.startswith("Traceback (most recent call last):"):
                self.in_traceback = True
            elif self.in_traceback and not line.startswith(" "):
                self.in_traceback = False
            quiet = self.in_traceback
            if f := _FAILED.match(line):
                self.failures.append((int(f.group(1)), int(f.group(2))))
            elif f := _FIRST_FAILED.match(line):
                self.first_failure = (int(f.group(1)), self.first_failure[1])
            elif f := _FIRST_CODE.match(line):
                self.first_failure = (self.first_failure[0], int(f.group(1)))
        self.combined.write(out + "\n")
        if not quiet:
            self.echo(out)

    def note(self, text: str) -> None:
        self.combined.write(f"[launcher] {text}\n")

    def close(self) -> None:
        self.combined.close()
        for handle in self.rank_logs.values():
            handle.close()

    def failing_rank(self) -> tuple[int | None, int | None]:
        if self.first_failure[0] is not None:
            return self.first_failure
        return self.failures[0] if self.failures else (None, None)


def normalize_exit(code: int | None) -> int:
    if code is None:
        return 1
    if code < 0:
        return 128 + (-code)
    return code if 0 < code < 256 else (1 if code else 0)


# --- the launch --------------------------------------------------------------------------------
def new_run_id(framework: str) -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{framework}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise OperatorError(
            f"invalid run id {run_id!r}: use up to 100 letters, digits, '-', '_' and '.' (not '.' or '..')"
        )
    return run_id


def parse_hosts(text: str) -> list[str]:
    """--hosts: comma-separated registry hostnames, each once."""
    hosts = [host.strip() for host in text.split(",") if host.strip()]
    if not hosts:
        raise OperatorError("no host names given: pass comma-separated registry hostnames (node-0,node-1)")
    bad = [host for host in hosts if not HOSTNAME.fullmatch(host)]
    if bad:
        raise OperatorError(f"invalid host name {bad[0]!r}: letters, digits, '-', '_' and '.' only")
    repeated = sorted({host for host in hosts if hosts.count(host) > 1})
    if repeated:
        raise OperatorError(f"{', '.join(repeated)} named more than once")
    return hosts


def _tar_bytes(files: dict[str, tuple[str, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, (text, mode) in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _run_keypair() -> tuple[str, str, str, str]:
    """A key pair and a host key for one run (docker runtime)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = []
        for name in ("id", "host"):
            path = Path(tmp) / name
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hvd-run-{name}", "-f", str(path)], check=True
            )
            out += [path.read_text(), Path(f"{path}.pub").read_text()]
    return out[0], out[1], out[2], out[3]


def _data_dir_in(job_args: Sequence[str]) -> str | None:
    for i, arg in enumerate(job_args):
        if arg == "--data-dir" and i + 1 < len(job_args):
            return job_args[i + 1]
        if arg.startswith("--data-dir="):
            return arg.split("=", 1)[1]
    return None


def launch(desc: ClusterDescription, opts: LaunchOptions, echo: Callable[[str], None] | None = None) -> RunResult:
    """Run one job end to end. Raises OperatorError for problems found before the job starts; returns a
    RunResult (exit_code = the job's) once it has started, whatever happened to it."""
    wanted, slots, image, local_dir = _check_options(desc, opts)
    run_id = local_dir.name
    data_dir = _data_dir_in(opts.job_args)

    with SSH(desc) as ssh:
        # 1. nodes
        # every ready node is a candidate (or exactly --hosts); preflight picks the healthy ones
        pool = wait_for_nodes(desc, ssh, wanted, opts.hosts, opts.wait_timeout)
        ssh.set_nodes(pool)
        # 2. preflight
        expected_gpus = slots if desc.gpus_per_node else 0
        checks = preflight(desc, ssh, pool, data_dir=data_dir, image=image, expected_gpus=expected_gpus)
        console.print(preflight_table(checks))
        bad = [c for c in checks if not c.ok]
        if bad and opts.abort_on_unhealthy:
            raise OperatorError(
                "preflight failed (--abort-on-unhealthy): "
                + "; ".join(f"{c.hostname}: {', '.join(c.problems)}" for c in bad),
                ExitCode.NOT_READY,
            )
        healthy = [n for n, c in zip(pool, checks, strict=True) if c.ok]
        if bad:
            console.print(f"[yellow]excluding unhealthy nodes: {', '.join(c.hostname for c in bad)}[/yellow]")
        if len(healthy) < wanted:
            reasons = "; ".join(f"{c.hostname}: {', '.join(c.problems)}" for c in bad)
            raise OperatorError(f"only {len(healthy)} healthy nodes, {wanted} needed ({reasons})", ExitCode.NOT_READY)
        nodes = healthy[:wanted]
        world = len(nodes) * slots
        hosts_by_rank = rank_hosts(nodes, slots)

        # 3. run files on the shared file system (written through the launch node)
        local_dir.mkdir(parents=True, exist_ok=True)
        run_dir = f"{desc.shared_mount_path.rstrip('/')}/runs/{run_id}"
        metrics_remote = f"{run_dir}/metrics.json"
        run_key = None
        files: dict[str, tuple[str, int]] = {"hostfile": (hostfile_text(nodes, slots), 0o644)}
        if desc.runtime.kind == "docker":
            run_key, run_pub, host_key, _host_pub = _run_keypair()
            files["ssh/authorized_keys"] = (run_pub, 0o644)
            files["ssh/host_ed25519"] = (host_key, 0o600)
        files.update(ssh_files_for_horovodrun(desc, nodes, run_dir, run_key))
        launch_node = ssh.node(nodes[0].hostname)
        ssh.run(
            launch_node,
            f"mkdir -p {q(run_dir)} && chmod 0777 {q(run_dir)} && tar -xf - -C {q(run_dir)}",
            input=_tar_bytes(files),
            timeout=60,
        )
        (local_dir / "hostfile").write_text(files["hostfile"][0])
        command = horovodrun_command(desc, opts, run_id, run_dir, world, metrics_remote)
        record = {
            "run_id": run_id,
            "framework": opts.framework,
            "cluster": desc.name,
            "provider": desc.provider,
            "nodes": [{"hostname": n.hostname, "address": n.address} for n in nodes],
            "slots_per_node": slots,
            "world_size": world,
            "job_args": opts.job_args,
            "command": command,
            "image": image,
            "preflight": [asdict(c) for c in checks],
            "started_at": datetime.now(UTC).isoformat(),
        }
        (local_dir / "run.json").write_text(json.dumps(record, indent=2))
        console.print(f"run {run_id}: {world} processes on {', '.join(n.hostname for n in nodes)}")

        result = RunResult(run_id, 1, local_dir, [n.hostname for n in nodes], world)
        streamer = Streamer(local_dir, hosts_by_rank, echo)
        proc: subprocess.Popen | None = None
        previous = _install_signal_handlers()
        try:
            if desc.runtime.kind == "docker":
                _start_containers(desc, ssh, nodes, run_id, run_dir, image or "", slots)
            proc = ssh.popen(launch_node, command, text=True, bufsize=1)
            timer = _job_timer(proc, opts.job_timeout)
            assert proc.stdout is not None
            for line in proc.stdout:
                streamer.feed(line)
            proc.wait()
            if timer:
                timer.cancel()
            result.exit_code = _job_exit(proc.returncode, streamer, result, hosts_by_rank, nodes)
        except (KeyboardInterrupt, Terminated) as exc:
            result.interrupted = True
            result.exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 143
            result.message = "interrupted: stopping every process of the run on every node"
            console.print(f"[yellow]{result.message}[/yellow]")
        except OperatorError as exc:
            result.exit_code = exc.exit_code or 1
            result.message = str(exc)
            console.print(f"[red]{exc}[/red]")
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
            try:
                if proc is not None:
                    stop_process_group(proc)
                result.stray_processes = cleanup(desc, ssh, nodes, run_id)
                streamer.note(f"clean-up: {result.stray_processes}")
                result.metrics = _fetch_metrics(ssh, launch_node, metrics_remote, local_dir)
            finally:
                streamer.close()
                _restore_signal_handlers(previous)
        record.update(
            finished_at=datetime.now(UTC).isoformat(),
            exit_code=result.exit_code,
            failed_rank=result.failed_rank,
            failed_host=result.failed_host,
            interrupted=result.interrupted,
            message=result.message,
            metrics=result.metrics,
        )
        (local_dir / "run.json").write_text(json.dumps(record, indent=2))
    if opts.upload:
        try:
            result.results_url = upload_results(desc, local_dir, run_id)
        except OperatorError as exc:
            console.print(f"[red]results upload failed: {exc}[/red]")
            result.message = (result.message + "; " if result.message else "") + f"upload failed: {exc}"
            if result.exit_code == 0:
                result.exit_code = exc.exit_code
    return result


def _check_options(desc: ClusterDescription, opts: LaunchOptions) -> tuple[int, int, str | None, Path]:
    """What can be wrong with the request before any connection: (nodes, processes per node, image,
    the run's local directory)."""
    if opts.framework not in FRAMEWORKS:
        raise OperatorError(f"--framework must be one of {', '.join(FRAMEWORKS)}")
    wanted = len(opts.hosts) if opts.hosts else (opts.nodes or desc.node_count)
    if wanted < 1:
        raise OperatorError("--nodes must be at least 1")
    slots = opts.gpus_per_node or desc.gpus_per_node or 1
    if desc.gpus_per_node and slots > desc.gpus_per_node:
        raise OperatorError(f"--gpus-per-node {slots} is more than the {desc.gpus_per_node} GPUs of a node")
    image = None
    if desc.runtime.kind == "docker":
        image = opts.image or desc.image_for(opts.framework)
        if not image:
            raise OperatorError(f"no image for {opts.framework} in the cluster description; pass --image")
    run_id = check_run_id(opts.run_id) if opts.run_id else new_run_id(opts.framework)
    local_dir = check_directory(opts.runs_dir, "--runs-dir") / run_id  # made once the job is about to start
    if local_dir.exists():
        raise OperatorError(f"run id {run_id} is already used ({local_dir} exists): pass another --run-id")
    return wanted, slots, image, local_dir


def _job_exit(
    code: int, streamer: Streamer, result: RunResult, hosts_by_rank: list[str], nodes: Sequence[NodeRecord]
) -> int:
    if code == 0:
        return 0
    if code == 255 and not streamer.failures:
        result.message = f"lost the SSH connection to the launch node {nodes[0].hostname}"
        console.print(f"[red]{result.message}[/red]")
        return 255
    rank, rank_code = streamer.failing_rank()
    if rank is not None:
        result.failed_rank = rank
        result.failed_host = hosts_by_rank[rank] if rank < len(hosts_by_rank) else None
        exit_code = normalize_exit(rank_code)
        if exit_code == 255:
            how = "exited with status 255 (killed, or its SSH session dropped)"
        elif 128 < exit_code < 128 + 65:
            how = f"exited with status {exit_code} (signal {exit_code - 128})"
        else:
            how = f"exited with status {exit_code}"
        result.message = f"job failed: rank {rank} on {result.failed_host} {how}"
        if streamer.job_error:
            result.message += f": {streamer.job_error}"
        console.print(f"[red]{result.message}[/red]")
        return exit_code
    result.message = f"horovodrun exited with status {code}"
    console.print(f"[red]{result.message}[/red]")
    return normalize_exit(code)


def _job_timer(proc: subprocess.Popen, timeout: float | None) -> threading.Timer | None:
    if not timeout:
        return None

    def expire() -> None:
        console.print(f"[red]job timeout ({timeout:.0f}s): stopping it[/red]")
        stop_process_group(proc)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    return timer


def _start_containers(
    desc: ClusterDescription, ssh: SSH, nodes: Sequence[NodeRecord], run_id: str, run_dir: str, image: str, slots: int
) -> None:
    cmd = docker_run_command(desc, run_id, run_dir, image, gpus=desc.gpus_per_node > 0)
    results = ssh.run_parallel([ssh.node(n.hostname) for n in nodes], cmd, timeout=300, check=True)
    failed = {h: str(r) for h, r in results.items() if isinstance(r, OperatorError)}
    if failed:
        raise OperatorError(
            "could not start the job containers: " + "; ".join(f"{h}: {e}" for h, e in failed.items()), ExitCode.FAILED
        )


def cleanup(desc: ClusterDescription, ssh: SSH, nodes: Sequence[NodeRecord], run_id: str) -> dict[str, int]:
    """Stop the run's processes on every node; returns node -> processes (or containers) stopped."""
    results = ssh.run_parallel([ssh.node(n.hostname) for n in nodes], sweep_command(desc, run_id), timeout=60)
    stopped = {}
    for host, res in results.items():
        if isinstance(res, OperatorError):
            console.print(f"[red]clean-up on {host} failed: {res}[/red]")
            stopped[host] = -1
            continue
        values = dict(line.split("=", 1) for line in res.stdout.split() if "=" in line)
        stopped[host] = int(values.get("stopped", "0") or 0)
        if int(values.get("left", "0") or 0):
            console.print(f"[red]{host}: {values['left']} processes of run {run_id} survived SIGKILL[/red]")
    return stopped


def _fetch_metrics(ssh: SSH, node: Target, remote: str, local_dir: Path) -> dict | None:
    try:
        proc = ssh.run(node, f"cat {q(remote)} 2>/dev/null || true", timeout=60, check=False)
    except OperatorError as exc:
        console.print(f"[yellow]could not fetch metrics: {exc}[/yellow]")
        return None
    text = proc.stdout.strip()
    if not text:
        return None
    try:
        metrics = json.loads(text)
    except json.JSONDecodeError:
        console.print(f"[yellow]metrics file {remote} is not JSON[/yellow]")
        return None
    (local_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def upload_results(desc: ClusterDescription, local_dir: Path, run_id: str) -> str:
    """Upload runs/<run-id>/ to the results container under <run-id>/; returns its URL."""
    client = blobs.container_client(desc.results)
    cred = desc.results.credential
    sas = cred.secret.get_secret_value() if cred.kind == "sas" and cred.secret else None
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        name = f"{run_id}/{path.relative_to(local_dir).as_posix()}"
        try:
            blobs.upload_file(client, path, name)
        except Exception as exc:  # azure-core raises many types: one message
            raise blobs.explain(exc, f"uploading results to {desc.results.url}", sas) from None
    return f"{desc.results.url}/{run_id}/"


def _install_signal_handlers() -> dict[int, object]:
    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, terminate)
        # Ctrl-C always interrupts a launch, even where SIGINT was ignored at start (background jobs)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return previous


def _restore_signal_handlers(previous: dict[int, object]) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        with contextlib.suppress(TypeError, ValueError):
            signal.signal(sig, handler)  # type: ignore[arg-type]


# --- CLI ---------------------------------------------------------------------------------------
def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="python -m scripts.launch",
        description="Launch a Horovod job on the cluster: ready nodes -> preflight -> horovodrun -> logs -> results.",
        epilog="Everything after `--` goes to the job (python -m training.<framework> --help). "
        "Once the job has started, the exit status is the job's own (which follows the same table).",
    )
    parser.add_argument("--framework", required=True, choices=FRAMEWORKS)
    parser.add_argument("--nodes", type=int_between(1), help="nodes to use (default: the cluster's node count)")
    parser.add_argument(
        "--gpus-per-node", type=int_between(1), help="processes per node (default: GPUs per node; 1 on CPU)"
    )
    parser.add_argument(
        "--hosts", type=arg_type(parse_hosts), help="comma-separated registry hostnames to use instead of --nodes"
    )
    parser.add_argument(
        "--cluster", type=non_empty, help="cluster description (default $CLUSTER_DESCRIPTION or the local cluster)"
    )
    parser.add_argument(
        "--wait-timeout", type=non_negative_number, default=60.0, help="seconds to wait for ready nodes (60)"
    )
    parser.add_argument("--abort-on-unhealthy", action="store_true", help="abort instead of excluding bad nodes")
    parser.add_argument("--entrypoint", type=non_empty, help="job module or .py path instead of training.<framework>")
    parser.add_argument("--image", type=non_empty, help="docker runtime: image to run instead of the framework's")
    parser.add_argument("--runs-dir", type=non_empty, default=str(DEFAULT_RUNS_DIR), help="where runs/<run-id>/ goes")
    parser.add_argument("--run-id", type=arg_type(check_run_id), help="default: <UTC time>-<framework>-<random>")
    parser.add_argument("--no-upload", action="store_true", help="do not upload the run to the results container")
    parser.add_argument("--job-timeout", type=positive_number, help="stop the job after this many seconds")
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="-- then the job's own flags")
    return parser


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    job_args = list(args.job_args)
    if job_args and job_args[0] == "--":
        job_args = job_args[1:]
    return LaunchOptions(
        framework=args.framework,
        job_args=job_args,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        hosts=args.hosts,
        wait_timeout=args.wait_timeout,
        abort_on_unhealthy=args.abort_on_unhealthy,
        entrypoint=args.entrypoint,
        image=args.image,
        runs_dir=Path(args.runs_dir),
        run_id=args.run_id,
        upload=not args.no_upload,
        job_timeout=args.job_timeout,
    )


def _run(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    result = launch(desc, options_from_args(args))
    where = f"; results {result.results_url}" if result.results_url else ""
    status = "ok" if result.exit_code == 0 else f"exit {result.exit_code}"
    console.print(f"run {result.run_id}: {status}; logs {result.run_dir}{where}")
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
