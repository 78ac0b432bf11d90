"""A local node's daemons, started the same way by `up` and by the power programs that resume a node.

A node (netns mode) is a network namespace with, inside it, an sshd that is the first process of
its own hostname, process table and mounts (`unshare --uts --pid --mount-proc`), and a slurmd that
joins those namespaces. Its own mounts give it a node-local disk (STATE/nvme/<node>, seen at
STATE/nvme-local) and its own accounts (STATE/etc/<node>, seen at /etc: dtrain/local/accounts.py).
Killing the sshd (PID 1 there) ends every process of the node, as a machine that is switched off.
Daemons run in their own session (nothing that started them waits for them), with their output in
STATE/logs/<role>.log, and are recorded in the cluster's state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from dtrain.errors import ExitCode, OperatorError
from dtrain.local import accounts as local_accounts
from dtrain.local import gpus as local_gpus
from dtrain.local import slurm_conf
from dtrain.local.network import sh
from dtrain.local.state import LocalState, NodeState, ProcessRecord
from dtrain.processes import children
from infra.users import KEYS_DIR

SSHD = "/usr/sbin/sshd"
# The NFS server and the nodes run the remote tools with the system python (as on Azure): proves
# they need only the stdlib.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
SPOT_AGENT = Path(__file__).resolve().parents[1] / "remote" / "boot" / "spot_agent.py"
# What the agent runs to release the shared file system (executable: its #! line names the system python).
SHARED_RELEASE = Path(__file__).resolve().parents[1] / "remote" / "boot" / "shared_release.py"
# How often the agent reads its node's Slurm comment for the power program's request: the local
# cluster's suspend waits seconds where Azure's waits a minute and a half.
RELEASE_POLL_S = 0.5
SSHD_WAIT_S = 20


def sshd_config(path: Path, listen: str, port: int, host_key: Path, admin: tuple[str, Path], log_level: str) -> None:
    """admin: the admin user and the file of their keys; every other person's key is in KEYS_DIR/<name>
    (what apply_users.py writes from the users list), as on Azure."""
    admin_user, authorized_keys = admin
    path.write_text(
        "\n".join(
            [
                f"ListenAddress {listen}",
                f"Port {port}",
                f"HostKey {host_key}",
                "PidFile none",
                f"AuthorizedKeysFile {KEYS_DIR}/%u",
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
                f"Match User {admin_user}",
                f"    AuthorizedKeysFile {authorized_keys}",
                "",
            ]
        )
    )


def keygen(path: Path, comment: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return path.with_name(path.name + ".pub").read_text().strip()


def sshd_config_path(state: LocalState, role: str) -> Path:
    return Path(state.state_dir) / "sshd" / f"{role}.conf"


def start_daemon(
    state: LocalState, role: str, argv: list[str], marker: str, *, umask: int = -1, env: dict[str, str] | None = None
) -> int:
    """Start a daemon in its own session, output to STATE/logs/<role>.log (0600), and record its pid.
    umask: the daemon's (-1: this process's), for one that creates files without choosing their mode;
    env: added to this process's environment (a secret it needs, never in its argv)."""
    with open(os.open(state.logs / f"{role}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=umask,
            env={**os.environ, **env} if env else None,
        )
    state.add_process(ProcessRecord(role=role, pid=proc.pid, marker=marker))
    state.save()
    return proc.pid


def node_nvme_dir(state: LocalState, hostname: str) -> Path:
    """What a node sees at local_data_dir: its node-local disk, as the host sees it."""
    return Path(state.state_dir) / "nvme" / hostname


def local_data_dir(state: LocalState) -> Path:
    """The description's local_data_path: one path on every node, each node's own content (netns mode)."""
    return Path(state.state_dir) / "nvme-local"


def start_sshd(state: LocalState, node: NodeState) -> None:
    """The node's sshd, with the configuration `up` wrote for it (STATE/sshd/<node>.conf)."""
    cfg = sshd_config_path(state, node.hostname)
    if state.mode == "netns":
        # own hostname (UTS) and own process table (PID + /proc): like a separate machine, `ps` on
        # a node shows only that node's processes; when its sshd stops, the kernel ends them all
        unshare = ["unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
        # its own "NVMe": the mount namespace is private, so every node sees its own directory at one path
        nvme, local = node_nvme_dir(state, node.hostname), local_data_dir(state)
        nvme.mkdir(parents=True, exist_ok=True)
        local.mkdir(exist_ok=True)
        files = slurm_conf.SlurmFiles(Path(state.state_dir))
        cgroup = local_gpus.mount_script(files, node.hostname) if state.gpus_per_node else ""
        etc = local_accounts.bind_etc(state, node.hostname)
        script = f'hostname {node.hostname} && {etc} && mount --bind "$1" "$2" && {cgroup}exec {SSHD} -D -e -f "$0"'
        namespaces = ["ip", "netns", "exec", str(node.namespace), *unshare]
        argv = [*namespaces, "sh", "-c", script, str(cfg), str(nvme), str(local)]
    else:
        argv = [SSHD, "-D", "-e", "-f", str(cfg)]
    start_daemon(state, node.hostname, argv, str(cfg))


def start_slurmd(state: LocalState, node: NodeState) -> None:
    """The node's slurmd, inside the namespaces of its sshd (which must be running)."""
    assert state.slurm_conf is not None  # netns mode configures Slurm before any slurmd starts
    conf = Path(state.slurm_conf)
    argv = slurm_conf.slurmd_argv(node_init_pid(state, node), node.hostname, conf)
    start_daemon(state, slurm_conf.slurmd_role(node.hostname), argv, str(conf))


def start_spot_agent(state: LocalState, node: NodeState) -> None:
    """The node's Spot agent (dtrain/remote/boot/spot_agent.py), inside the node's namespaces like its slurmd:
    it reaches the node's metadata endpoint, and goes when the node is switched off."""
    assert state.slurm_conf is not None
    argv = [*enter_node(state, node), "env", f"SLURM_CONF={state.slurm_conf}", SYSTEM_PYTHON, str(SPOT_AGENT)]
    argv += ["--node", node.hostname, *_release_arguments(state)]
    start_daemon(state, spot_agent_role(node.hostname), argv, str(SPOT_AGENT))


def _release_arguments(state: LocalState) -> list[str]:
    """The agent's release of the shared file system's stand-in (`up(release_mount=...)`), if there is one."""
    if not state.release_mount:
        return []
    mount = ["--release-program", str(SHARED_RELEASE), "--release-mount", state.release_mount]
    return [*mount, "--release-poll", str(RELEASE_POLL_S)]


def start_users_agent(state: LocalState, host: str, enter: list[str]) -> None:
    """The loop that applies the users list on host (dtrain/local/accounts.py), inside its namespaces (enter)."""
    argv = local_accounts.agent_argv(state, host, enter, SYSTEM_PYTHON)
    start_daemon(state, local_accounts.agent_role(host), argv, str(local_accounts.APPLY_USERS))


def enter_node(state: LocalState, node: NodeState) -> list[str]:
    """The argv prefix that runs a command inside the node (its network, hostname, processes and mounts),
    where it ends when the node is switched off."""
    return ["nsenter", f"--target={node_init_pid(state, node)}", "--net", "--uts", "--pid", "--mount"]


def spot_agent_role(node: str) -> str:
    return f"spot-agent-{node}"


def exporter_roles(node: str) -> tuple[str, str]:
    """The roles of a node's telemetry daemons (dtrain/local/telemetry.py): node_exporter, the GPU stand-in."""
    return f"node-exporter-{node}", f"gpu-exporter-{node}"


def node_init_pid(state: LocalState, node: NodeState) -> int:
    """The first process inside a node's namespaces (its sshd): what slurmd joins."""
    pid = running_init_pid(state, node)
    if pid is None:
        log = state.logs / f"{node.hostname}.log"
        raise OperatorError(f"the sshd of {node.hostname} is not running (see {log})", ExitCode.FAILED)
    return pid


def running_init_pid(state: LocalState, node: NodeState) -> int | None:
    """The node's first process (netns mode), or None when the node is not running."""
    record = state.record(node.hostname)
    found = children(record.pid) if record is not None and record.alive() else []
    return found[0] if len(found) == 1 else None


def node_roles(node: str) -> tuple[str, ...]:
    """The roles of a node's daemons in the state record: its sshd, its slurmd, its Spot agent, its exporters,
    its users' loop."""
    roles = (node, slurm_conf.slurmd_role(node), spot_agent_role(node), *exporter_roles(node))
    return (*roles, local_accounts.agent_role(node))
