"""A job's MLflow tracking, on the operator's side: which server, and the batch script's lines for it.

The cluster's own server (Azure: `mlflow server` on the head node; locally: in the head namespace) is the
cluster description's ``tracking_uri``; ``launch --tracking-uri`` points a run at another one (an Azure ML
workspace's MLflow endpoint, say), or ``none`` turns tracking off. The batch script opens the run
(dtrain/remote/job/mlflow_run.py) in the experiment named for the cluster (``--experiment`` another), named
for the run id and tagged with who launched it, the Slurm job and the framework, so that a user finds theirs
in a shared server; it exports ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID`` to every rank; a server's
token is ``MLFLOW_TRACKING_TOKEN`` in the job's environment, never in the script.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request

from dtrain.cluster.ssh import q
from dtrain.errors import OperatorError
from dtrain.jobs.job_spec import ScriptLines, Tracking

OFF = "none"
TOKEN = "MLFLOW_TRACKING_TOKEN"  # a server's bearer token: a task's secret, read by mlflow_run.py
# what the job's containers (docker runtime) get from the batch script's environment
CONTAINER_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", TOKEN)
_EXPERIMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/ -]{0,199}")


# MLflow 3's UI opens in its GenAI view, where a training run is listed among "Evaluation runs"; this query
# parameter opens its model-training view (Runs, metrics and system metrics charts) instead
TRAINING_VIEW = "workflowType=machine_learning"
PAGE_LOOKUP_TIMEOUT_S = 5
# ours; MLflow's own tag for the user (its runs table's User column) is set by the job, to the Slurm user it
# runs as (dtrain/remote/job/mlflow_run.py), not to the name of whoever launched it on their own machine
FRAMEWORK_TAG = "dtrain.framework"


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


def plan_tracking(
    cluster_uri: str | None,
    uri: str | None,
    experiment: str | None,
    *,
    cluster: str,
    framework: str,
    prometheus_url: str | None = None,
) -> Tracking | None:
    """The run's server: ``uri`` (from --tracking-uri) over the cluster's; None: not tracked. The experiment is
    the cluster's name unless ``experiment`` (--experiment) names another. With the cluster's Prometheus, the
    run gets its nodes' system metrics (dtrain/remote/job/system_metrics.py)."""
    chosen = uri or cluster_uri
    if not chosen or chosen == OFF:
        return None
    tags = {FRAMEWORK_TAG: framework}
    return Tracking(chosen, experiment or cluster, tags, prometheus_url)


def script_lines(tracking: Tracking | None) -> ScriptLines:
    """job.sh's lines for the run's MLflow run: opened in the prologue, closed in finish()."""
    if tracking is None:
        return ScriptLines()
    return ScriptLines(prologue=_open_run_lines(tracking), on_finish=_CLOSE_RUN_LINES)


def _open_run_lines(tracking: Tracking) -> list[str]:
    """Open the run before the launch; a server that does not answer leaves the job untracked, not failed.
    Then the system metrics' sampler, in the background until finish() (_CLOSE_RUN_LINES) stops it."""
    tags = "".join(f" --tag {q(f'{key}={value}')}" for key, value in tracking.tags.items())
    start = (
        f'"$PY" "$TOOLS/mlflow_run.py" start --run-dir "$RUN_DIR" --experiment {q(tracking.experiment)} '
        f'--run-name "$RUN_ID"{tags}'
    )
    lines = [
        f"export MLFLOW_TRACKING_URI={q(tracking.uri)}",
        # it logs the run's page itself ([job] MLflow run ID at URL)
        f"MLFLOW_RUN_ID=$({start}) && export MLFLOW_RUN_ID",
    ]
    if tracking.prometheus_url:
        sampler = (
            f'"$PY" "$TOOLS/system_metrics.py" --run-dir "$RUN_DIR" --prometheus {q(tracking.prometheus_url)} '
            '--job "$SLURM_JOB_ID" --nodes "$HOSTS"'
        )
        lines.append(f'if [ -n "${{MLFLOW_RUN_ID:-}}" ]; then {sampler} & SYSTEM_METRICS_PID=$!; fi')
    return lines


# in finish(): the sampler's end, then the run's status from the job's (FINISHED, FAILED or KILLED)
_CLOSE_RUN_LINES = (
    '  [ -n "${SYSTEM_METRICS_PID:-}" ] && kill "$SYSTEM_METRICS_PID" 2>/dev/null',
    '  [ -n "${MLFLOW_RUN_ID:-}" ] && "$PY" "$TOOLS/mlflow_run.py" end --run-dir "$RUN_DIR" --exit-code "$code" '
    '--ended-by "$ENDED_BY"',
)


def experiment_page(base_url: str, experiment: str) -> str:
    """The UI's page of ``experiment`` (its runs) on the server at ``base_url``, in the model-training view; the
    experiments list where the server has none of that name yet (no run so far) or does not answer."""
    base = base_url.rstrip("/")
    query = urllib.parse.urlencode({"experiment_name": experiment})
    try:
        url = f"{base}/api/2.0/mlflow/experiments/get-by-name?{query}"
        with urllib.request.urlopen(url, timeout=PAGE_LOOKUP_TIMEOUT_S) as answer:
            found = json.load(answer)["experiment"]["experiment_id"]
    except (OSError, ValueError, KeyError):  # 404: no such experiment yet
        return f"{base}/#/experiments?{TRAINING_VIEW}"
    return f"{base}/#/experiments/{found}?{TRAINING_VIEW}"
