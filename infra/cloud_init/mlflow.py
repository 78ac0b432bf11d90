"""The head node's MLflow tracking server, as cloud-config pieces that render_head_node adds.

`mlflow server` (requirements-mlflow.txt's pins, in a venv of its own, installed at first boot by
mlflow-setup.service) runs as the unprivileged `mlflow` user under systemd (mlflow.service), listening on
the head's private address only: the cluster subnet's jobs reach it, an operator through an SSH tunnel over
the jumpbox; no NSG rule names its port (infra/network.py admits the cluster subnet, and SSH from the
jumpbox, nothing else). Its backend store is SQLite on the head's disk (/var/lib/mlflow); its artifacts
(the runs' models, uploaded through its proxy) go to the `results` container under mlflow/, written with
an identity of its own (infra/tracking.py) whose only role is on that container: no key, no secret in
custom data.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

from infra.cloud_init._common import check_client_id, read_unit, write_file
from infra.contract import MLFLOW_PORT, MLFLOW_SERVER_ENV

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements-mlflow.txt"
UNITS = ("mlflow-setup.service", "mlflow.service")
CONFIG_DIR = "/etc/mlflow"
STATE_DIR = "/var/lib/mlflow"
USER = "mlflow"
PACKAGES = ["python3-venv"]  # Ubuntu 22.04's python3 (3.10) makes the server's venv
ARTIFACTS_PREFIX = "mlflow"  # under the results container: beside the runs' own folders
_BLOB_ENDPOINT = re.compile(r"https://([a-z0-9]{3,24})\.blob\.core\.windows\.net/?")
_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}")


def artifacts_uri(results_endpoint: str, container: str) -> str:
    """``wasbs://<container>@<account>.blob.core.windows.net/mlflow``, MLflow's name for a blob folder."""
    match = _BLOB_ENDPOINT.fullmatch(results_endpoint or "")
    if not match:
        raise ValueError(f"results_endpoint: {results_endpoint!r} is not an Azure blob endpoint")
    if not _CONTAINER.fullmatch(container or ""):
        raise ValueError(f"results container: {container!r} is not a container name")
    return f"wasbs://{container}@{match.group(1)}.blob.core.windows.net/{ARTIFACTS_PREFIX}"


def server_env(listen_ip: str, results_endpoint: str, container: str, identity_client_id: str) -> str:
    """/etc/mlflow/server.env: where it listens and writes, and which identity it writes with."""
    if not ipaddress.IPv4Address(listen_ip).is_private or ipaddress.IPv4Address(listen_ip).is_unspecified:
        raise ValueError(f"MLflow listen address: {listen_ip!r} is not a private address")
    values = {
        "MLFLOW_HOST": listen_ip,
        "MLFLOW_PORT": str(MLFLOW_PORT),
        "MLFLOW_ARTIFACTS": artifacts_uri(results_endpoint, container),
        # azure-identity's DefaultAzureCredential: the user-assigned identity of this client id (IMDS)
        "AZURE_CLIENT_ID": check_client_id("tracking identity_client_id", identity_client_id),
        **MLFLOW_SERVER_ENV,
    }
    return "".join(f"{key}={value}\n" for key, value in values.items())


def mlflow_files(tracking: dict[str, str]) -> list[dict[str, Any]]:
    """tracking: server_env's arguments, by name."""
    env = server_env(**tracking)
    return [
        write_file(f"{CONFIG_DIR}/requirements.txt", REQUIREMENTS.read_text(), "0644"),
        write_file(f"{CONFIG_DIR}/server.env", env, "0644"),
        *(write_file(f"/etc/systemd/system/{unit}", read_unit(unit), "0644") for unit in UNITS),
    ]


def mlflow_commands() -> list[list[str]]:
    """runcmd: its user and state directory, then both units, without waiting (the install takes minutes)."""
    return [
        ["useradd", "--system", "--home-dir", STATE_DIR, "--shell", "/usr/sbin/nologin", USER],
        ["install", "-d", "-o", USER, "-g", USER, "-m", "0700", STATE_DIR],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", "--no-block", *UNITS],
    ]
