"""cloud-config for the jumpbox (Ubuntu 22.04): the people's accounts, which only forward their connections
into the cluster (no shell), from its own copy of the users list (it mounts no shared file system)."""

from __future__ import annotations

from infra.cloud_init._common import cloud_config
from infra.cloud_init.users import NOLOGIN, HostUsers, seed_file, users_commands, users_files
from infra.users import JUMPBOX_LIST, UsersList


def render_jumpbox(users: UsersList) -> str:
    """cloud-config that applies users (its first copy of the list) as every host does, every 30 s."""
    host = HostUsers(list_path=JUMPBOX_LIST, home_root="/home", shell=NOLOGIN)
    files = [*users_files(host), seed_file(JUMPBOX_LIST, users)]
    return cloud_config({"write_files": files, "runcmd": users_commands()})
