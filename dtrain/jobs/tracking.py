"""A job's MLflow tracking, on the operator's side: which server, and the batch script's lines for it.

The cluster's own server (Azure: `mlflow server` on the head node; locally: in the head namespace) is the
cluster description's ``tracking_uri``; ``launch --tracking-uri`` points a run at another one (an Azure ML
workspace's MLflow endpoint, say), or ``none`` turns tracking off. The batch script opens the run
(dtrain/remote/job/mlflow_run.py) and exports ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID`` to every rank;
a server's token is ``MLFLOW_TRACKING_TOKEN`` in the job's environment, never in the script.
"""

from __future__ import annotations

import argparse
import re
import urllib.parse
from dataclasses import dataclass

from dtrain.cli_common import arg_type
from dtrain.cluster.ssh import q
from dtrain.errors import OperatorError

DEFAULT_EXPERIMENT = "dtrain"
OFF = "none"
TOKEN = "MLFLOW_TRACKING_TOKEN"  # a server's bearer token: a task's secret, read by mlflow_run.py
# what the job's containers (docker runtime) get from the batch script's environment
CONTAINER_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", TOKEN)
_EXPERIMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/ -]{0,199}")


@dataclass(frozen=True)
class Tracking:
    uri: str  # http(s)://host:port of an MLflow tracking server, as the nodes reach it
    experiment: str = DEFAULT_EXPERIMENT


def check_tracking_uri(text: str) -> str:
    if "@" in urllib.parse.urlsplit(text).netloc:  # the URI is written to job.sh, job.json and the log
        raise OperatorError(
            "--tracking-uri must not hold credentials (user:password@), which job.sh, job.json and the log would "
            f"keep: export {TOKEN}=... and pass it as a secret (--secret {TOKEN}, or the task file's secrets)"
        )  # the URI itself is not repeated: it holds them
    if text == OFF or (re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", text) and _port_in_range(text)):
        return text.rstrip("/")
    raise OperatorError(
        f"--tracking-uri must be an http:// or https:// URL of an MLflow server (a port, if any, from 1 to 65535), "
        f"or {OFF!r}: {text!r}"
    )


def _port_in_range(url: str) -> bool:
    """A port, where the URL names one, from 1 to 65535: 99999 would only fail on the nodes, untracked."""
    try:
        port = urllib.parse.urlsplit(url).port
    except ValueError:  # out of range, or not a number
        return False
    return port != 0


def check_experiment(text: str) -> str:
    if _EXPERIMENT.fullmatch(text):
        return text
    raise OperatorError(f"--experiment must be up to 200 letters, digits, '._/ -', not {text!r}")


def plan_tracking(cluster_uri: str | None, uri: str | None, experiment: str | None) -> Tracking | None:
    """The run's server: ``uri`` (from --tracking-uri) over the cluster's; None: not tracked."""
    chosen = uri or cluster_uri
    if not chosen or chosen == OFF:
        return None
    return Tracking(chosen, experiment or DEFAULT_EXPERIMENT)


def open_run_lines(tracking: Tracking) -> list[str]:
    """Open the run before the launch; a server that does not answer leaves the job untracked, not failed."""
    start = (
        f'"$PY" "$TOOLS/mlflow_run.py" start --run-dir "$RUN_DIR" --experiment {q(tracking.experiment)} '
        '--run-name "$RUN_ID"'
    )
    return [
        f"export MLFLOW_TRACKING_URI={q(tracking.uri)}",
        f"MLFLOW_RUN_ID=$({start}) && export MLFLOW_RUN_ID && "
        'echo "[job] MLflow run $MLFLOW_RUN_ID at $MLFLOW_TRACKING_URI"',
    ]


# in finish(): the run's status from the job's (FINISHED, FAILED or KILLED)
CLOSE_RUN_LINE = (
    '  [ -n "${MLFLOW_RUN_ID:-}" ] && "$PY" "$TOOLS/mlflow_run.py" end --run-dir "$RUN_DIR" --exit-code "$code"'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracking-uri",
        type=arg_type(check_tracking_uri),
        metavar="URI",
        help="MLflow server for this run's parameters, curves and model (default: the cluster's, on its head "
        f"node; {OFF!r}: none); its token, if it needs one, is MLFLOW_TRACKING_TOKEN in the job's environment",
    )
    parser.add_argument(
        "--experiment",
        type=arg_type(check_experiment),
        help=f"MLflow experiment of the run (default: {DEFAULT_EXPERIMENT})",
    )
