"""The local cluster's MLflow tracking server: `mlflow server` in the head namespace, as on Azure's head node.

Its backend store is a SQLite file under STATE/mlflow, its artifacts (the runs' models) go to Azurite's
`results` container under mlflow/, as on Azure they go to the real one (through the server: jobs upload
through its artifact proxy and hold no storage credential; the server has Azurite's connection string in
its environment, never in its argv). It runs from its own environment, .venv-mlflow (`make setup`,
requirements-mlflow.txt): the server's dependencies (SQLAlchemy, Flask, FastAPI, pandas...) are neither
the operator's nor the training image's business.

`up` starts it and does not wait: it takes 10 to 50 s to answer on a busy machine (two Python processes,
each importing MLflow; the first start also creates its database), while Slurm comes up beside it. A job
that starts before it answers runs untracked (one line in its log says so); `dtrain local status` shows
it. `dtrain demo`, whose one job is there to be seen, waits for it (:func:`wait_until_answers`).
"""

from __future__ import annotations

from pathlib import Path

from dtrain.cluster.description import REPO_ROOT
from dtrain.local.daemons import http_answers
from dtrain.local.nodes import start_daemon
from dtrain.local.state import AZURITE_ACCOUNT, LocalState
from infra.contract import MLFLOW_PORT, MLFLOW_SERVER_ENV

ROLE = "mlflow"
ENVIRONMENT = REPO_ROOT / ".venv-mlflow"
ARTIFACTS = f"wasbs://results@{AZURITE_ACCOUNT}.blob.core.windows.net/mlflow"


def server_argv(mlflow: Path, host: str, store: Path, artifacts: str) -> list[str]:
    """`mlflow server` as both clusters run it: one worker (a cluster's jobs log a few requests a second),
    artifacts proxied to ``artifacts``."""
    return [
        str(mlflow),
        "server",
        *("--host", host, "--port", str(MLFLOW_PORT), "--workers", "1"),
        *("--backend-store-uri", f"sqlite:///{store}"),
        *("--artifacts-destination", artifacts),
    ]


def start(state: LocalState, azurite_connection_string: str) -> None:
    """In the head namespace (netns mode only, beside slurmctld); nothing when .venv-mlflow is missing."""
    mlflow = ENVIRONMENT / "bin" / "mlflow"
    if state.head is None or state.head.namespace is None or not mlflow.exists():
        return
    store = Path(state.state_dir) / "mlflow"
    store.mkdir(mode=0o700, exist_ok=True)
    argv = server_argv(mlflow, state.head.address, store / "mlflow.db", ARTIFACTS)
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string, **MLFLOW_SERVER_ENV}
    start_daemon(state, ROLE, ["ip", "netns", "exec", state.head.namespace, *argv], str(store), env=env)


def tracking_uri(state: LocalState) -> str | None:
    """Where jobs and the operator reach it: the head namespace's address, from the host and every node."""
    if state.head is None or not any(record.role == ROLE for record in state.processes):
        return None
    return f"http://{state.head.address}:{MLFLOW_PORT}"


def wait_until_answers(uri: str, timeout_s: float) -> bool:
    """Whether the server at ``uri`` answers its health check within ``timeout_s`` (0: now)."""
    return http_answers(f"{uri}/health", timeout_s)
