#!/usr/bin/env python3
"""Open and close a job's MLflow run: run by the batch script on the first node of the allocation.

  mlflow_run.py start --run-dir DIR --experiment NAME --run-name NAME [--tag KEY=VALUE ...]   # prints the run id
  mlflow_run.py end --run-dir DIR --exit-code N [--ended-by time_limit]

A new experiment is marked as model training (the tag ``mlflow.experimentKind``), and ``start`` logs the
run's page in MLflow's model-training view (``?workflowType=machine_learning``): MLflow 3 opens in its GenAI
view otherwise, where a training run is listed among "Evaluation runs".

The server is ``$MLFLOW_TRACKING_URI``; ``$MLFLOW_TRACKING_TOKEN``, when set, goes as a bearer token
(never on a command line): from the environment, else from the run's secrets (a task file's `secrets`,
DIR/secrets/env, which only the user's command sources: this process reads that one name itself).
``start`` keeps the id in DIR/mlflow_run_id, so a requeued attempt goes on
logging to the same run; the job exports it as ``MLFLOW_RUN_ID`` for the ranks (training/run/tracking.py)
and for the user's own code. A server that does not answer costs the job at most a few seconds: start
exits 1 with one line (the job runs untracked), end gives up.

Standard library only (and job_secrets.py, beside it in the run's remote/): the nodes' system python runs
it, outside the training image.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from job_secrets import read_secrets  # beside this file in the run's remote/

RUN_ID_FILE = "mlflow_run_id"
TOKEN = "MLFLOW_TRACKING_TOKEN"
SECRETS_FILE = "secrets/env"  # dtrain/jobs/task_steps.py; its format: job_secrets.py
TIMEOUT_S = 10.0
EXPERIMENT_KIND = {"key": "mlflow.experimentKind", "value": "custom_model_development"}  # MLflow's "Machine learning"
# the UI's model-training view (its default is GenAI), as dtrain/jobs/tracking.py has it (nothing of the operator's
# is imported here: the nodes run this file alone)
TRAINING_VIEW = "workflowType=machine_learning"
# the job's exit status -> the run's status (143: scancel or the time limit, 130: interrupted); a job its
# time limit ended is KILLED whatever its status (75: it saved a checkpoint when warned, then stopped)
STATUS = {0: "FINISHED", 143: "KILLED", 130: "KILLED"}
TIME_LIMIT = "time_limit"  # status.json's ended_by


def request(endpoint: str, body: dict, method: str = "POST") -> dict:
    uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    headers = {"Content-Type": "application/json"}
    if token := os.environ.get(TOKEN):
        headers["Authorization"] = f"Bearer {token}"
    url, data = f"{uri}/api/2.0/mlflow/{endpoint}", json.dumps(body).encode()
    if method == "GET":
        url, data = f"{url}?{urllib.parse.urlencode(body)}", None
    with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=TIMEOUT_S) as r:
        return json.loads(r.read() or b"{}")


def experiment_id(name: str) -> str:
    try:
        return request("experiments/get-by-name", {"experiment_name": name}, "GET")["experiment"]["experiment_id"]
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
    try:
        return request("experiments/create", {"name": name, "tags": [EXPERIMENT_KIND]})["experiment_id"]
    except urllib.error.HTTPError as exc:  # another job made it meanwhile
        if exc.code != 400:
            raise
        return request("experiments/get-by-name", {"experiment_name": name}, "GET")["experiment"]["experiment_id"]


def start(run_dir: Path, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    kept = run_dir / RUN_ID_FILE
    if kept.exists():  # a requeued attempt: the same run, running again (under a new Slurm job id, maybe)
        run_id = kept.read_text().strip()
        request("runs/update", {"run_id": run_id, "status": "RUNNING"})
        request("runs/set-tag", {"run_id": run_id, "key": "slurm.job_id", "value": os.environ.get("SLURM_JOB_ID", "")})
        return run_id
    ours = {"dtrain.run_id": run_name, "slurm.job_id": os.environ.get("SLURM_JOB_ID", "")}
    # whose run it is, where MLflow's UI shows it (its User column), and their Slurm account
    ours |= {"mlflow.user": os.environ.get("SLURM_JOB_USER") or getpass.getuser()}
    ours |= {"slurm.account": os.environ.get("SLURM_JOB_ACCOUNT", "")}
    body = {
        "experiment_id": experiment_id(experiment),
        "run_name": run_name,
        "start_time": int(time.time() * 1000),
        "tags": [{"key": key, "value": value} for key, value in {**tags, **ours}.items()],
    }
    info = request("runs/create", body)["run"]["info"]
    kept.write_text(info["run_id"] + "\n")
    return info["run_id"]


def run_page(run_id: str) -> str:
    """The run's page in the UI, in its model-training view (the server's address where it does not say)."""
    uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    try:
        experiment = request("runs/get", {"run_id": run_id}, "GET")["run"]["info"]["experiment_id"]
    except (OSError, ValueError, KeyError):  # the run is open: a page it cannot name costs nothing more
        return uri
    return f"{uri}/#/experiments/{experiment}/runs/{run_id}?{TRAINING_VIEW}"


def tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--tag takes KEY=VALUE, not {text!r}")
    return key, value


def end(run_dir: Path, exit_code: int, ended_by: str) -> None:
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    status = "KILLED" if ended_by == TIME_LIMIT else STATUS.get(exit_code, "FAILED")
    request("runs/update", {"run_id": run_id, "status": status, "end_time": int(time.time() * 1000)})


def token_from_secrets(run_dir: Path) -> str | None:
    """The run's MLflow token among its secrets, or None."""
    return read_secrets(str(run_dir / SECRETS_FILE)).get(TOKEN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    opening = sub.add_parser("start")
    opening.add_argument("--experiment", required=True)
    opening.add_argument("--run-name", required=True)
    opening.add_argument("--tag", type=tag, action="append", default=[], help="a tag of the run, KEY=VALUE")
    closing = sub.add_parser("end")
    closing.add_argument("--exit-code", type=int, required=True)
    closing.add_argument("--ended-by", default="", help=f"status.json's ended_by ({TIME_LIMIT!r} or empty)")
    for command in (opening, closing):
        command.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not os.environ.get(TOKEN) and (token := token_from_secrets(args.run_dir)):
        os.environ[TOKEN] = token  # this process's own: it starts none
    try:
        if args.command == "start":
            run_id = start(args.run_dir, args.experiment, args.run_name, dict(args.tag))
            print(run_id)
            print(f"[job] MLflow run {run_id} at {run_page(run_id)}", file=sys.stderr)
        else:
            end(args.run_dir, args.exit_code, args.ended_by)
    except (OSError, ValueError, KeyError) as exc:  # URLError and HTTPError are OSErrors
        what = "the run is not tracked" if args.command == "start" else "its MLflow run stays open"
        print(f"[job] MLflow at {uri} did not answer ({exc}): {what}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
