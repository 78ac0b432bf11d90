"""cloud-config pieces that apply the cluster's users list on a host, the same on every role: apply-users
(dtrain/remote/boot/apply_users.py, shipped verbatim), its service (at boot, before slurmd) and timer
(every 30 s: a change reaches every host within a minute), and sshd reading each person's key from
infra/users.py's KEYS_DIR. Only public keys travel: the list holds nothing else of a person's.

Which list a host reads and where the homes are differ by role (HostUsers): the head node and the nodes
read the shared file system's, the NFS server its export's, the jumpbox (no shared file system) its own
copy, which `dtrain users` refreshes over SSH.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from infra.cloud_init._common import check_path, read_unit, remote_file, write_file
from infra.contract import RUNS_DIR, WORKDIRS_DIR
from infra.users import APPLIED_DIR, HOMES_DIR, KEYS_DIR, LIST_FILE, USERS_DIR, UsersList

APPLY_USERS_PATH = "/usr/local/sbin/apply-users"
ARGS_PATH = "/etc/default/dtrain-users"  # the unit's EnvironmentFile: this role's arguments
SERVICE, TIMER = "dtrain-users.service", "dtrain-users.timer"
TIMER_INTERVAL_S = 30  # dtrain-users.timer's OnUnitActiveSec
SSHD_DROP_IN = "/etc/ssh/sshd_config.d/50-dtrain-users.conf"
# Where the head node and the jumpbox keep the stack config's list (public keys only) for their first boot.
SEED_PATH = "/var/lib/dtrain-users/seed.json"
# The head node (slurmdbd's host): the people apply-users made Slurm users, the ones it may remove.
SLURM_USERS_PATH = "/var/lib/dtrain-users/slurm-users"
NOLOGIN = "/usr/sbin/nologin"  # the jumpbox forwards a person's connections, and gives them no shell


@dataclass(frozen=True)
class HostUsers:
    """How a role applies the list: the list's path, where the homes are (in passwd), where its report goes,
    whether it makes the homes and opens the team's directories (the head node), the people's shell, and
    where it keeps the people it made Slurm users (the head node, beside slurmdbd; None: Slurm's not its)."""

    list_path: str
    home_root: str
    report_dir: str | None = None
    make_homes: bool = False
    team_dirs: tuple[str, ...] = ()
    shell: str = "/bin/bash"
    slurm_users: str | None = None

    def arguments(self) -> list[str]:
        args = ["--list", check_path("list_path", self.list_path), "--home-root", check_path("home", self.home_root)]
        args += ["--report-dir", check_path("report_dir", self.report_dir)] if self.report_dir else []
        args += ["--make-homes"] if self.make_homes else []
        args += [f"--team-dir={check_path('team_dir', d)}" for d in self.team_dirs]
        args += ["--slurm-users", check_path("slurm_users", self.slurm_users)] if self.slurm_users else []
        return [*args, "--shell", check_path("shell", self.shell)]


def on_shared(mount: str, *, head: bool = False) -> HostUsers:
    """A host that mounts the shared file system at mount (the nodes; head: the head node, which keeps the
    list, makes the homes, opens runs/, its workdir caches and the dataset area to every person, and makes
    each person a Slurm user of their account)."""
    users = posixpath.join(mount, USERS_DIR)
    runs = posixpath.join(mount, RUNS_DIR)
    team = (runs, posixpath.join(runs, WORKDIRS_DIR), posixpath.join(mount, "data")) if head else ()
    return HostUsers(
        list_path=posixpath.join(users, LIST_FILE),
        home_root=posixpath.join(mount, HOMES_DIR),
        report_dir=posixpath.join(users, APPLIED_DIR),
        make_homes=head,
        team_dirs=team,
        slurm_users=SLURM_USERS_PATH if head else None,
    )


def users_files(host: HostUsers) -> list[dict[str, Any]]:
    """apply-users, its arguments for this role, its service and timer, and sshd's drop-in."""
    return [
        write_file(APPLY_USERS_PATH, remote_file("boot/apply_users.py"), "0755"),
        write_file(ARGS_PATH, f"APPLY_USERS_ARGS={' '.join(host.arguments())}\n", "0644"),
        *(write_file(f"/etc/systemd/system/{unit}", read_unit(unit), "0644") for unit in (SERVICE, TIMER)),
        # the admin's key stays where Azure put it (~/.ssh/authorized_keys); a person's is root's file
        write_file(SSHD_DROP_IN, f"AuthorizedKeysFile .ssh/authorized_keys {KEYS_DIR}/%u\n", "0644"),
    ]


def seed_file(path: str, users: UsersList) -> dict[str, Any]:
    """The stack config's list, as the hosts read it: names, uids, public keys, accounts, limits."""
    return write_file(path, users.document(), "0644")


SSHD_RELOAD = ["systemctl", "try-reload-or-restart", "ssh"]  # runcmd: sshd takes the drop-in


def users_commands() -> list[list[str]]:
    """runcmd of a role that starts no setup program of its own (the NFS server, the jumpbox): sshd takes
    the drop-in, and the list is applied now, at every boot and every 30 s."""
    return [["systemctl", "daemon-reload"], SSHD_RELOAD, ["systemctl", "enable", "--now", TIMER, SERVICE]]
