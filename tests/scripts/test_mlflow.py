"""MLflow on the local cluster (the real `mlflow server` in the head namespace, real Slurm, Horovod across
two node namespaces): a running 2-node job's loss curve is read through MLflow's REST API mid-run and shown
by MLflow's UI in headless Chromium; killing the server mid-run neither fails nor stalls the job.

The browser is Debian's chromium on its command line (--dump-dom, then --screenshot): no driver or
DevTools client to install or keep in step with the browser's version, and each call ends on its own
(--virtual-time-budget lets the UI's requests finish first)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from datetime import datetime

import pytest
from PIL import Image

from dtrain.jobs.batch_script import REMOTE_TOOLS, render_job_script
from dtrain.jobs.job_spec import Tracking
from dtrain.jobs.tracking import CONTAINER_ENV, OFF, plan_tracking
from dtrain.local import mlflow_server as local_mlflow
from dtrain.local.state import load_state
from dtrain.processes import descendants
from dtrain.remote.job.job_secrets import render_secrets
from tests.local_http import reply_json, serving
from tests.polling import wait_for

from .conftest import REPO, local_state_dir
from .test_batch import BASE
from .test_job_reliability import pytorch_launch, tiny_imagenet
from .test_launcher import cli, job_id_of, run_dir, squeue_state, status_of

SERVER_START_S = 240  # `up` does not wait for it; on a loaded 2-core machine it takes up to a minute or more
LOSS = "train/loss"
END_STALL_BOUND_S = 15  # the job's end, waiting for a sender whose server is gone (refused connections)


def api(uri: str, endpoint: str, **params: str) -> dict:
    url = f"{uri}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def server(cluster) -> str:
    assert cluster.tracking_uri, "the local cluster names its MLflow server (.venv-mlflow: make setup)"
    wait_for(lambda: healthy(cluster.tracking_uri), SERVER_START_S, "MLflow to answer", interval=1)
    return cluster.tracking_uri


def mlflow_run_of(cluster, run_id: str) -> str:
    kept = run_dir(cluster, run_id) / "mlflow_run_id"
    return wait_for(lambda: kept.exists() and kept.read_text().strip(), 120, "the job's MLflow run", interval=0.5)


def loss_history(uri: str, mlflow_run: str) -> list[dict]:
    return api(uri, "metrics/get-history", run_id=mlflow_run, metric_key=LOSS).get("metrics", [])


def chromium(*args: str, url: str) -> subprocess.CompletedProcess:
    browser = shutil.which("chromium")
    assert browser, "chromium (Debian's package) is installed by tools/setup_system.sh"
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars"]
    argv += ["--window-size=1280,1600", "--virtual-time-budget=20000", *args, url]
    # a hang guard: a page and its scripts in about 10 s idle, several times that on a loaded machine
    # (over 300 s once at load 20)
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def test_job_script_opens_the_run_exports_it_to_every_rank_and_closes_it():
    tracked = replace(BASE, tracking=Tracking("http://10.40.63.254:5000", "my experiment"))
    text = render_job_script(tracked)
    lines = text.splitlines()
    assert "export MLFLOW_TRACKING_URI=http://10.40.63.254:5000" in lines
    opening = next(line for line in lines if 'mlflow_run.py" start' in line)
    assert "--experiment 'my experiment'" in opening and '--run-name "$RUN_ID"' in opening
    assert "system_metrics.py" not in text  # no Prometheus named: no sampler
    assert opening.startswith("MLFLOW_RUN_ID=$(") and "&& export MLFLOW_RUN_ID" in opening
    assert lines.index(opening) < next(i for i, line in enumerate(lines) if "horovodrun --gloo" in line)
    closing = 'mlflow_run.py" end --run-dir "$RUN_DIR" --exit-code "$code" --ended-by "$ENDED_BY"'
    assert any(closing in line for line in lines)
    for name in CONTAINER_ENV:  # into the containers by name: the token's value is never in the script
        assert f"-e {name} " in text
    assert "mlflow_run.py" in REMOTE_TOOLS
    untracked = render_job_script(BASE)
    assert "MLFLOW" not in untracked and "mlflow_run.py" not in untracked


@pytest.mark.parametrize(
    ("cluster_uri", "flag", "expected"),
    [
        ("http://10.0.0.4:5000", None, "http://10.0.0.4:5000"),
        (
            "http://10.0.0.4:5000",
            "https://example.azureml.ms/mlflow/v1.0/x",
            "https://example.azureml.ms/mlflow/v1.0/x",
        ),
        ("http://10.0.0.4:5000", OFF, None),
        (None, None, None),
    ],
)
def test_a_run_is_tracked_by_the_clusters_server_unless_told_otherwise(cluster_uri, flag, expected):
    plan = plan_tracking(cluster_uri, flag, None, cluster="hvd", framework="keras")
    assert (plan.uri if plan else None) == expected
    if plan:  # the cluster's experiment, and what finds a user's run there
        assert plan.experiment == "hvd" and plan.tags == {"dtrain.framework": "keras"}  # the job adds mlflow.user


@pytest.mark.parametrize("value", ["ftp://host", "10.0.0.4:5000", "http://", "http://a b"])
def test_a_tracking_uri_that_is_not_an_http_url_is_refused_before_anything_is_sent(tmp_path, value):
    cluster_file = tmp_path / "cluster.json"  # never read: the flag is refused first
    proc = cli("launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--tracking-uri", value, "--dry-run")
    assert proc.returncode == 2 and "--tracking-uri" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["http://alice:pa55w0rd@10.0.0.4:5000", "https://pa55w0rd@ml.example/mlflow"])
def test_credentials_in_a_tracking_uri_are_refused_without_repeating_them_pointing_to_the_token_secret(tmp_path, value):
    """job.sh, job.json and the log would keep the URI: its server's token goes as a secret instead."""
    cluster_file = tmp_path / "cluster.json"  # never read: the flag is refused first
    proc = cli("launch", "--cluster", str(cluster_file), "--framework", "pytorch", "--tracking-uri", value, "--dry-run")
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and proc.stdout == "", proc.stderr
    assert "must not hold credentials" in errors[0] and "--secret MLFLOW_TRACKING_TOKEN" in errors[0], errors
    assert "pa55w0rd" not in proc.stderr


def test_a_running_jobs_loss_curve_is_in_mlflow_and_its_ui(cluster, cluster_file, tmp_path):
    uri = server(cluster)
    data = tiny_imagenet(cluster, "mlflow-imagenet")
    proc = cli(*pytorch_launch(cluster_file, data, "mlflow-live", "--detach", steps=100_000))
    assert proc.returncode == 0, proc.stderr
    job_id = job_id_of(proc)
    try:
        mlflow_run = mlflow_run_of(cluster, "mlflow-live")
        points = wait_for(lambda: len(loss_history(uri, mlflow_run)) >= 3, 180, "3 loss points", interval=1)
        assert points and squeue_state(cluster, job_id) == "RUNNING"  # read while the job runs
        history = loss_history(uri, mlflow_run)
        assert sorted(point["step"] for point in history)[:3] == [1, 2, 3]  # --log-every 1: every step
        run = api(uri, "runs/get", run_id=mlflow_run)["run"]
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert (params["batch_size"], params["steps"], params["model"]) == ("4", "100000", "resnet_tiny")
        assert run["info"]["status"] == "RUNNING" and run["info"]["run_name"] == "mlflow-live"
        experiment = run["info"]["experiment_id"]
        page = f"{uri}/#/experiments/{experiment}/runs/{mlflow_run}"
        dom = chromium("--dump-dom", url=page)
        assert LOSS in dom.stdout and "mlflow-live" in dom.stdout, dom.stdout[-2000:] + dom.stderr[-2000:]
        shot = tmp_path / "run.png"
        chromium(f"--screenshot={shot}", url=f"{page}/model-metrics")
        with Image.open(shot) as image:
            colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50, "the screenshot is blank"  # a rendered page, not one color
    finally:
        cli("cancel", "--cluster", str(cluster_file), job_id)
    ended = wait_for(lambda: api(uri, "runs/get", run_id=mlflow_run)["run"]["info"]["status"] != "RUNNING", 120, "")
    assert ended and api(uri, "runs/get", run_id=mlflow_run)["run"]["info"]["status"] == "KILLED"


def stop_server(cluster) -> None:
    record = load_state(local_state_dir(cluster)).record(local_mlflow.ROLE)
    assert record is not None and record.alive()
    for pid in [record.pid, *descendants(record.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not record.alive(), 30, "MLflow to stop", interval=0.2)


def test_killing_mlflow_mid_run_neither_fails_nor_stalls_the_job(cluster, cluster_file):
    uri = server(cluster)
    data = tiny_imagenet(cluster, "mlflow-imagenet")
    proc = cli(*pytorch_launch(cluster_file, data, "mlflow-killed", "--detach", steps=12))
    assert proc.returncode == 0, proc.stderr
    job_id = job_id_of(proc)
    mlflow_run = mlflow_run_of(cluster, "mlflow-killed")
    try:
        wait_for(lambda: loss_history(uri, mlflow_run), 180, "the first loss point", interval=0.5)
        stop_server(cluster)
        killed_at = time.monotonic()
        wait_for(lambda: squeue_state(cluster, job_id) == "", 240, "the job to end", interval=0.5)
        after_kill = time.monotonic() - killed_at
    finally:
        state = load_state(local_state_dir(cluster))
        local_mlflow.start(state, cluster.staging_credential.secret.get_secret_value())
    log = (run_dir(cluster, "mlflow-killed") / "output.log").read_text()
    assert status_of(cluster, "mlflow-killed")["exit_code"] == 0, log[-3000:]
    assert "[0|node-0]" in log and re.search(r"step 12/12", log), log[-3000:]
    # one warning for the outage, not one per step; the end of the job says what was lost
    assert len(re.findall(r"MLflow: dropping values until", log)) == 1, log[-3000:]
    assert "values were not recorded" in log, log[-3000:]
    assert "MLflow at" in log and "its MLflow run stays open" in log  # the job script's end: one line
    # Not stalled: the job's end waited for the sender a bounded time (FINISH_WAIT_S at most; a refused
    # connection costs less), from rank 0's metrics line to its report of what was lost
    ending = stamp_of(log, "metrics: "), stamp_of(log, "values were not recorded")
    assert ending[1] - ending[0] < END_STALL_BOUND_S, ending
    assert after_kill < 180, after_kill


def stamp_of(log: str, text: str) -> float:
    """When rank 0 logged the first line with ``text`` (its log lines' own time stamps)."""
    pattern = r"^\[0\|node-0\]!? (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 .*" + re.escape(text)
    found = re.search(pattern, log, re.M)
    assert found, text
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_the_job_script_opens_and_closes_the_run_with_a_token_kept_among_the_runs_secrets(tmp_path):
    """A server of the user's own that needs a token (an Azure ML workspace): the token is a task file's
    secret, which only the user's command sources; mlflow_run.py reads that one name from the run's
    secrets itself, and finish() closes the run before it removes them."""
    token, seen = "tok-3n", []

    class Server(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self) -> None:
            seen.append((self.path.split("?")[0], self.headers.get("Authorization")))
            if self.headers.get("Authorization") != f"Bearer {token}":
                reply_json(self, 401, {"error_code": "UNAUTHENTICATED"})
            elif "get-by-name" in self.path:
                reply_json(self, 200, {"experiment": {"experiment_id": "1"}})
            else:
                reply_json(self, 200, {"run": {"info": {"run_id": "r1"}}})

        do_GET = do_POST = _answer

    (tmp_path / "secrets").mkdir()
    # beside another secret that a line-by-line reader cannot parse: a key of several lines, with quotes
    key = '-----BEGIN KEY-----\nit\'s "quoted" \\ ü\n-----END KEY-----\n'
    (tmp_path / "secrets" / "env").write_bytes(render_secrets({"OTHER": key, "MLFLOW_TRACKING_TOKEN": token}))
    tool = REPO / "dtrain" / "remote" / "job" / "mlflow_run.py"
    with serving(Server) as uri:
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_TOKEN"} | {"MLFLOW_TRACKING_URI": uri}
        for args in (["start", "--experiment", "e", "--run-name", "n"], ["end", "--exit-code", "0"]):
            proc = subprocess.run(
                [sys.executable, str(tool), *args, "--run-dir", str(tmp_path)], env=env, capture_output=True, text=True
            )
            assert proc.returncode == 0, proc.stderr
    assert seen and all(auth == f"Bearer {token}" for _, auth in seen), seen
    finish = render_job_script(replace(BASE, tracking=Tracking("https://ml.example", "e"), secrets=("A",)))
    assert finish.index('mlflow_run.py" end') < finish.index("rm -rf /shared/runs/")
