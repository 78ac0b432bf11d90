"""`launch --workdir DIR`: the user's own code, sent to the cluster's shared file system with rsync.

rsync rather than a tarball of our own: it honours `.gitignore` files (as a per-directory filter, the
way git reads them), sends only what changed since the last launch of the same directory, resumes an
interrupted transfer (--partial), and reaches the login node through the jump host with the same
ssh_config every other command uses. The directory goes to a per-user cache on the share
(`<runs>/.workdirs/<cluster user>-<name>-<hash>`), and each run copies that cache into its own run directory
(`<run>/code`), so a run keeps the code it started with whatever is launched next.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dtrain.checks import require_tool
from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.ssh import SSH, q
from dtrain.errors import ExitCode, OperatorError
from infra.contract import WORKDIRS_DIR

CODE_SUBDIR = "code"  # in the run directory: where the command runs
CACHE_DIR = WORKDIRS_DIR  # in the runs directory: the last upload of each of a user's directories
MAX_WORKDIR_MB = 256  # code, not data: datasets go through `stage`, checkpoints stay on the cluster
# .gitignore files anywhere in the tree, as git reads them; .git itself never travels
FILTERS = ("--filter=:- .gitignore", "--exclude=/.git/")
# the cache is its user's alone, whatever the modes of the files on their machine (-a would copy those)
PRIVATE = "--chmod=go-rwx"
RSYNC_IO_TIMEOUT_S = 60  # rsync gives up when no data moves for this long (and can be run again to resume)
_TOTAL_SIZE = re.compile(r"^Total file size: ([\d,]+) bytes", re.M)
_FILES = re.compile(r"^Number of files: ([\d,]+)", re.M)


@dataclass(frozen=True)
class Workdir:
    path: Path
    size_bytes: int  # what rsync would send (after the excludes)
    files: int

    @property
    def name(self) -> str:
        """The directory's name as a run id takes it (letters, digits, '.', '_', '-')."""
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.path.name).strip(".-")[:40] or "workdir"


def check_workdir(text: str, max_mb: float = MAX_WORKDIR_MB) -> Workdir:
    """The directory, measured the way rsync will send it; too large, or not a directory, is refused."""
    path = Path(text).expanduser().resolve()
    if not path.is_dir():
        raise OperatorError(f"--workdir {text}: {'not a directory' if path.exists() else 'no such directory'}")
    require_tool("rsync", "install rsync (apt-get install rsync): it sends --workdir to the cluster")
    with tempfile.TemporaryDirectory(prefix="hvd-workdir-") as empty:
        proc = subprocess.run(
            ["rsync", "-a", "--dry-run", "--stats", *FILTERS, f"{path}/", f"{empty}/"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    size, files = _TOTAL_SIZE.search(proc.stdout), _FILES.search(proc.stdout)
    if proc.returncode != 0 or size is None or files is None:
        raise OperatorError(f"--workdir {path}: rsync cannot read it: {proc.stderr.strip()[-400:]}")
    workdir = Workdir(path, int(size.group(1).replace(",", "")), int(files.group(1).replace(",", "")))
    if workdir.size_bytes > max_mb * 2**20:
        raise OperatorError(
            f"--workdir {path} holds {workdir.size_bytes / 2**20:,.0f} MiB to send, more than {max_mb:g} MiB: list "
            "what need not travel (data, checkpoints, environments) in its .gitignore, stage data with `stage`, "
            "or raise --workdir-max-mb"
        )
    return workdir


def cache_path(workdir: Workdir, runs_dir: str, user: str) -> str:
    """One cache per cluster user and local directory: a second launch of it sends only what changed."""
    digest = hashlib.sha256(str(workdir.path).encode()).hexdigest()[:10]
    return posixpath.join(runs_dir, CACHE_DIR, f"{user}-{workdir.name}-{digest}")


def send_workdir(workdir: Workdir, desc: ClusterDescription, ssh: SSH, runs_dir: str) -> str:
    """rsync the directory to its cache on the share (through the jump host); returns the cache's path.
    The cache is its user's alone (0700); CACHE_DIR is open to every user where the cluster has users
    (the head's apply-users makes it 1777)."""
    cache = cache_path(workdir, runs_dir, desc.ssh_user)
    prepare = f"umask 077; mkdir -p -m 0755 {q(runs_dir)} && mkdir -p {q(cache)}"
    ssh.run(ssh.login, prepare, timeout=60)
    command = [
        "rsync", "-a", PRIVATE, "--delete", "--partial", f"--timeout={RSYNC_IO_TIMEOUT_S}", *FILTERS,
        "-e", f"ssh -F {q(ssh.config_path)}", f"{workdir.path}/", f"{ssh.login.alias}:{cache}/",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        code = ExitCode.NOT_READY if proc.returncode == 255 else ExitCode.FAILED
        raise OperatorError(
            f"sending --workdir {workdir.path} to {ssh.login.label} failed (run launch again to resume): "
            f"{proc.stderr.strip()[-400:]}",
            code,
        )
    return cache
