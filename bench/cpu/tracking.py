"""MLflow tracking overhead: our PyTorch job logging every step to a real `mlflow server` beside the same job
with tracking off, world size 1, interleaved rounds in one run.

The server is the one the clusters run (.venv-mlflow, requirements-mlflow.txt) on a loopback port with a
SQLite store in a temporary directory; the run is opened as the batch script opens it
(dtrain/remote/job/mlflow_run.py). ``--log-every 1``: a log point at every step, the worst case (the
default logs every 10 steps). The ratio is images/s with tracking over without: goal 0.99 (under 1%).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.harness import proc, steps
from bench.harness.results import Figure, median
from infra.contract import MLFLOW_SERVER_ENV
from training.run.tracking import MlflowRest, Tracker

MLFLOW = proc.REPO_ROOT / ".venv-mlflow" / "bin" / "mlflow"
OPEN_RUN = proc.REPO_ROOT / "dtrain" / "remote" / "job" / "mlflow_run.py"
SERVER_START_S = 300  # two processes importing MLflow: a minute or more on 2 loaded cores
KEY, GOAL = "tracking", 0.99
LOG_POINTS = 500  # within the sender's buffer: what a step pays, not what a full buffer drops


@contextlib.contextmanager
def mlflow_server() -> Iterator[str]:
    """A real `mlflow server` on a free loopback port, in a session of its own that is ended at the end."""
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as tmp:
        port = proc.free_port()
        argv = [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        argv += ["--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", f"{tmp}/artifacts"]
        env = proc.thread_env(1, MLFLOW_SERVER_ENV)
        with open(Path(tmp) / "server.log", "w") as log:
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        uri = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(uri, server)
            yield uri
        finally:
            os.killpg(server.pid, signal.SIGTERM)  # its session: the CLI and the uvicorn it started
            server.wait()


def _wait_healthy(uri: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise proc.BenchError(f"mlflow server exited with status {server.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{uri}/health", timeout=2):
            return
        time.sleep(1)
    raise proc.BenchError(f"mlflow server did not answer within {SERVER_START_S}s")


def open_run(uri: str, name: str) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-run-") as run_dir:
        cmd = ["python3", str(OPEN_RUN), "start", "--run-dir", run_dir, "--experiment", "bench", "--run-name", name]
        return proc.run(cmd, {**proc.thread_env(1), "MLFLOW_TRACKING_URI": uri}).strip()


def measure(shape: steps.Shape, rounds: int, threads: int) -> Figure:
    title = f"MLflow tracking overhead, {shape.describe()}, a log point every step, horovodrun -np 1"
    if not MLFLOW.exists():
        return Figure.skipped(KEY, title, f"{MLFLOW} is missing: make setup")
    every_step = ("--log-every", "1")
    ours: list[float] = []
    off: list[float] = []
    with mlflow_server() as uri:
        for i in range(rounds):  # interleaved pairs, alternating which goes first
            tracked = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": open_run(uri, f"bench-{i}")}
            pair = (
                lambda: off.append(_rate(shape, threads, every_step, {})),
                lambda tracked=tracked: ours.append(_rate(shape, threads, every_step, tracked)),
            )
            for run in pair if i % 2 == 0 else reversed(pair):
                run()
        cost_s = log_point_cost_s(uri, open_run(uri, "bench-log-points"))
    figure = Figure.from_rounds(
        KEY, title, "images/s", ours, off, goal=GOAL, ours_label="tracking on", baseline_label="tracking off"
    )
    step_s = shape.batch / median(off)
    share = 100 * cost_s / step_s
    figure.note = f"a log point costs the loop {cost_s * 1e6:.0f} us, {share:.3f}% of a {step_s * 1000:.0f} ms step"
    return figure


def log_point_cost_s(uri: str, run_id: str, points: int = LOG_POINTS) -> float:
    """What the loop pays per log point, measured where the rate's noise cannot hide it: the mean time of
    ``points`` calls of the job's own sender (training/run/tracking.py) with a log step's values."""
    tracker = Tracker(MlflowRest(uri, None), run_id)
    values = {"train/loss": 1.0, "train/lr": 0.1, "train/images_per_sec": 30.0}
    started = time.perf_counter()
    for step in range(points):
        tracker.metrics(step, values)
    cost = (time.perf_counter() - started) / points
    tracker.finish()
    return cost


def _rate(shape: steps.Shape, threads: int, extra: tuple[str, ...], env: dict[str, str]) -> float:
    args = ["--data", "synthetic", *shape.args(), *extra]
    metrics = proc.run_json("horovod", 1, "training.pytorch", args, threads, **env)
    return float(metrics["images_per_sec"])
