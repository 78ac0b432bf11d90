"""Shared pieces of the cloud-init renderers: input checks, script templates, YAML output."""

from __future__ import annotations

import gzip
import ipaddress
import re
import shlex
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import yaml

# Azure rejects customData larger than 65535 bytes (before base64; after gzip, see custom_data_bytes).
MAX_CUSTOM_DATA_BYTES = 65535
MUNGE_KEY_PATH = "/etc/munge/munge.key"
MUNGE_KEY_FETCH_PATH = "/usr/local/sbin/munge-key"  # head-setup and slurmd-setup run it before munged
MUNGE_KEY_SECRET = "slurm-munge-key"  # its name in the stack's Key Vault
DATABASE_PASSWORD_SECRET = "slurmdbd-database-password"  # slurmdbd's, in the same vault (the head node reads it)
# What runs on the hosts lives with the operator's tools (the local cluster runs it in place), grouped
# by when it runs (boot/, slurm/, job/, login/); a package of docstring-only __init__ files, so reading
# it imports nothing of the CLI.
REMOTE_PACKAGE = "dtrain.remote"

_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")
# A template line `# include <name>` becomes the text of <name> in the including file's folder: functions that
# several host scripts share, pasted in so that each installed script stays one file.
_INCLUDE = re.compile(r"^# include ([\w.-]+)$", re.MULTILINE)
# Paths land in fstab, /etc/exports and systemd units, which each escape differently: allow only
# characters that none of them treats specially.
_SAFE_PATH = re.compile(r"(/[A-Za-z0-9._-]+)+")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+")
_CLIENT_ID = re.compile(r"[A-Za-z0-9-]+")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # a Linux user name, as useradd takes it by default
# Key Vault names: 3-24 letters, digits and '-'; the public cloud's DNS suffix.
_VAULT_URI = re.compile(r"https://[A-Za-z][A-Za-z0-9-]{1,22}[A-Za-z0-9]\.vault\.azure\.net/?")

ScriptValue = str | int | Sequence[str]


def check_path(name: str, value: str) -> str:
    if not isinstance(value, str) or not _SAFE_PATH.fullmatch(value) or "/../" in f"{value}/":
        raise ValueError(f"{name}: {value!r} is not an absolute path of letters, digits, '.', '_', '-' and '/'")
    return value


def check_ipv4(name: str, value: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not an IPv4 address") from None


def check_cidr(name: str, value: str) -> str:
    try:
        network = ipaddress.IPv4Network(value, strict=True)
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not an IPv4 network in CIDR form, e.g. 10.0.0.0/24") from None
    if network.prefixlen == 0:
        raise ValueError(f"{name}: {value!r} would admit every address; give the cluster subnet")
    return str(network)


def check_hostname(name: str, value: str) -> str:
    if not isinstance(value, str) or not _HOSTNAME.fullmatch(value):
        raise ValueError(f"{name}: {value!r} is not a lower-case DNS name such as myacr.azurecr.io")
    return value


def check_client_id(name: str, value: str) -> str:
    # Azure issues GUIDs; anything URL-safe is accepted so that test doubles need not be, while a
    # resource ID passed by mistake (slashes) is still caught before it reaches the IMDS query.
    if not isinstance(value, str) or not _CLIENT_ID.fullmatch(value):
        raise ValueError(f"{name}: {value!r} is not a managed identity client ID (a GUID)")
    return value


def check_user(name: str, value: str) -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise ValueError(f"{name}: {value!r} is not a Linux user name")
    return value


def check_int(name: str, value: int, low: int, high: int) -> int:
    # bool is an int subclass; True as a disk count is a caller bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: {value!r} is not an integer from {low} to {high}")
    return value


def _shell_literal(value: ScriptValue) -> str:
    if isinstance(value, bool):
        raise TypeError("booleans have no shell form; pass a str or int")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return shlex.quote(value)
    return "(" + " ".join(shlex.quote(item) for item in value) + ")"


def remote_file(name: str) -> str:
    """The text of dtrain/remote/<group>/<name>, the folder of everything that runs on a cluster host."""
    return resources.files(REMOTE_PACKAGE).joinpath(*name.split("/")).read_text(encoding="utf-8")


def render_script(name: str, values: Mapping[str, ScriptValue]) -> str:
    """Fill the @NAME@ placeholders of dtrain/remote/<name> with shell-quoted values (lists become
    arrays), after pasting in the files its `# include` lines name."""
    folder = name.rpartition("/")[0]
    template = _INCLUDE.sub(lambda match: remote_file(f"{folder}/{match[1]}").rstrip("\n"), remote_file(name))
    wanted = set(_PLACEHOLDER.findall(template))
    if wanted != set(values):
        raise KeyError(f"{name}: placeholders {sorted(wanted)} but values for {sorted(values)}")
    return _PLACEHOLDER.sub(lambda match: _shell_literal(values[match[1]]), template)


def read_unit(name: str) -> str:
    """A systemd unit (or drop-in) of dtrain/remote/boot/, beside the boot script it starts."""
    return remote_file(f"boot/{name}")


def start_setup_unit(unit: str) -> list[list[str]]:
    """runcmd that enables a setup unit (node-setup or head-setup.service) for every boot until it has
    succeeded, and starts it without waiting: the unit runs after cloud-init's last stage, which is
    running this, and retries for longer than cloud-init should wait."""
    return [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", "--no-block", unit]]


def write_file(path: str, content: str, permissions: str, *, defer: bool = False) -> dict[str, Any]:
    """A write_files entry owned by root. defer: written after packages are installed (cloud-init's
    final stage), e.g. into a directory that a package creates, or before a service reads it."""
    entry: dict[str, Any] = {"path": path, "owner": "root:root", "permissions": permissions, "content": content}
    if defer:
        entry["defer"] = True
    return entry


def check_vault_uri(vault_uri: str) -> str:
    if not isinstance(vault_uri, str) or not _VAULT_URI.fullmatch(vault_uri):
        raise ValueError(f"key_vault_uri: {vault_uri!r} is not a Key Vault URI (https://NAME.vault.azure.net/)")
    return vault_uri


def munge_key_fetch_file(*, vault_uri: str, identity_client_id: str) -> dict[str, Any]:
    """The program that fetches the cluster's munge key from Key Vault at boot with the machine's
    identity (infra/key_vault.py): the key itself is never in custom data."""
    values = {
        "VAULT_URI": check_vault_uri(vault_uri),
        "SECRET_NAME": MUNGE_KEY_SECRET,
        "IDENTITY_CLIENT_ID": check_client_id("identity_client_id", identity_client_id),
        "KEY_PATH": MUNGE_KEY_PATH,
    }
    return write_file(MUNGE_KEY_FETCH_PATH, render_script("boot/munge-key.sh", values), "0755")


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (scripts, units) as readable literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


def cloud_config(document: Mapping[str, Any]) -> str:
    # yaml.safe_dump cannot take a Dumper; yaml.dump with a SafeDumper subclass is the same safe dump.
    body = yaml.dump(dict(document), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
    text = "#cloud-config\n" + body
    size = len(custom_data_bytes(text))
    if size > MAX_CUSTOM_DATA_BYTES:
        raise ValueError(f"cloud-config is {size} bytes gzipped; Azure custom data allows {MAX_CUSTOM_DATA_BYTES}")
    return text


def custom_data_bytes(cloud_config_text: str) -> bytes:
    """What a machine's custom data holds: the cloud-config gzipped, which cloud-init unpacks before
    reading it (user data in any format may come gzipped). Azure's 65,535 bytes are counted on this; a
    GPU node's document is over 60 KB plain and about a third of that gzipped. mtime=0: the same
    document always gives the same bytes, so an unchanged one never replaces the head node."""
    return gzip.compress(cloud_config_text.encode("utf-8"), compresslevel=9, mtime=0)
