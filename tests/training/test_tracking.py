"""training/run/tracking.py against stand-ins for an MLflow server (the real one is in
tests/scripts/test_mlflow.py): what it sends, and that a server that is slow, hung or gone never blocks
a step and costs the job's end at most the bounded wait."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from tests.local_http import reply_json, serving
from training.run import tracking

# What log points may cost the loop, whatever the server does: on average well under a millisecond; at
# worst (a loaded machine deschedules anyone) half of one request's timeout (0.5 s here), which a call
# that waited for the server would spend at least
MEAN_BUDGET_S, WORST_BUDGET_S = 0.001, 0.25


class Recorder(http.server.BaseHTTPRequestHandler):
    """An MLflow stand-in that records log-batch bodies and artifact uploads."""

    batches: ClassVar[list[dict]] = []
    artifacts: ClassVar[dict[str, bytes]] = {}
    token: ClassVar[list[str | None]] = []

    def do_POST(self) -> None:
        Recorder.token.append(self.headers.get("Authorization"))
        Recorder.batches.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        reply_json(self, 200, {})

    def do_GET(self) -> None:
        reply_json(self, 200, {"run": {"info": {"artifact_uri": "mlflow-artifacts:/7/abc/artifacts"}}})

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Recorder.artifacts[self.path] = body
        reply_json(self, 200, {})

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def hung_server() -> Iterator[str]:
    """Accepts connections and never answers: the worst server (each request waits out its timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # nobody listens once it is closed


@pytest.fixture
def environment(monkeypatch):
    def point_at(uri: str, token: str | None = None) -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("MLFLOW_RUN_ID", "abc")
        if token:
            monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)

    return point_at


def test_params_metrics_final_numbers_and_model_reach_the_server(environment, tmp_path: Path) -> None:
    Recorder.batches, Recorder.artifacts, Recorder.token = [], {}, []
    export = tmp_path / "export"
    (export / "weights").mkdir(parents=True)
    (export / "model.json").write_text("{}")
    (export / "weights" / "model.pt").write_bytes(b"\0" * 10)
    settings = SimpleNamespace(batch_size=4, lr=0.1, export_dir=export, data_dir=None)
    with serving(Recorder) as uri:
        environment(uri, token="s3cret")
        tracking.start(settings)
        for step in (1, 2, 3):
            tracking.metrics(step, {"train/loss": 1.0 / step, "train/images_per_sec": None})
        tracking.metrics(4, {"train/loss": float("nan")})  # no NaN in JSON: left out, never an error
        tracking.finish(settings, {"steps": 3, "images_per_sec": 12.5, "mfu": 0.41, "framework": "pytorch"})
    params = {p["key"]: p["value"] for batch in Recorder.batches for p in batch["params"]}
    assert params == {"batch_size": "4", "lr": "0.1", "export_dir": str(export)}  # unset ones left out
    metrics = [(m["key"], m["step"], m["value"]) for batch in Recorder.batches for m in batch["metrics"]]
    assert [m for m in metrics if m[0] == "train/loss"] == [
        ("train/loss", 1, 1.0),
        ("train/loss", 2, 0.5),
        ("train/loss", 3, 1 / 3),
    ]
    assert ("final/mfu", 3, 0.41) in metrics and ("final/images_per_sec", 3, 12.5) in metrics
    assert any(key == "memory/rank0_host_peak_gib" for key, *_ in metrics)
    assert all(batch["run_id"] == "abc" for batch in Recorder.batches)
    assert set(Recorder.token) == {"Bearer s3cret"}
    assert Recorder.artifacts == {
        "/api/2.0/mlflow-artifacts/artifacts/7/abc/artifacts/model/model.json": b"{}",
        "/api/2.0/mlflow-artifacts/artifacts/7/abc/artifacts/model/weights/model.pt": b"\0" * 10,
    }


def test_without_a_run_in_the_environment_nothing_is_sent(monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_port())
    tracking.start(SimpleNamespace(lr=0.1))
    assert not tracking.enabled() and tracking._tracker is None
    tracking.metrics(1, {"train/loss": 1.0})  # does nothing
    tracking.finish(SimpleNamespace(), {})


@pytest.mark.parametrize("server", ["gone", "hung"])
def test_a_dead_or_hung_server_never_blocks_a_step_and_the_end_waits_a_bounded_time(
    environment, caplog, monkeypatch, server: str
) -> None:
    """Gone (connections refused): values are dropped, with one warning. Hung (accepts, never answers: as
    a slow server looks): values wait in the buffer until the end's bounded wait, then count as lost."""
    caplog.set_level(logging.WARNING, logger="training.run.tracking")
    monkeypatch.setattr(tracking, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(tracking, "RETRY_WAIT_S", 0.05)
    monkeypatch.setattr(tracking, "FINISH_WAIT_S", 3.0)
    monkeypatch.setattr(tracking, "BUFFER", 1000)
    with hung_server() if server == "hung" else _nothing(closed_port()) as uri:
        environment(uri)
        settings = SimpleNamespace(lr=0.1)
        tracking.start(settings)
        took = []
        for step in range(2000):  # more than the buffer holds: the overflow is dropped, not waited for
            started = time.perf_counter()
            tracking.metrics(step, {"train/loss": 1.0})
            took.append(time.perf_counter() - started)
        assert sum(took) / len(took) < MEAN_BUDGET_S and max(took) < WORST_BUDGET_S, (sum(took), max(took))
        started = time.monotonic()
        tracker = tracking._tracker
        tracking.finish(settings, {"steps": 2000})
        ending = time.monotonic() - started
    assert ending <= tracking.FINISH_WAIT_S + 1, ending
    assert tracker is not None and tracker.dropped > 0
    warnings = [r.getMessage() for r in caplog.records]
    outage = "dropping values" if server == "gone" else "is slow or busy"
    assert sum(outage in w for w in warnings) == 1, warnings  # once, not once per value
    assert any("values were not recorded" in w for w in warnings), warnings
    assert not any(threading.current_thread() is t for t in threading.enumerate() if t.name == "mlflow-tracking")


class SlowThenFine(Recorder):
    """A loaded MLflow: its first answers come after the client's timeout, or say it is busy (503)."""

    late: ClassVar[int] = 0
    busy: ClassVar[int] = 0

    def do_POST(self) -> None:
        if SlowThenFine.late > 0:
            SlowThenFine.late -= 1
            time.sleep(tracking.REQUEST_TIMEOUT_S * 2)  # it records the batch, but too late for the client
        elif SlowThenFine.busy > 0:
            SlowThenFine.busy -= 1
            self.rfile.read(int(self.headers["Content-Length"]))
            reply_json(self, 503, {"error_code": "TEMPORARILY_UNAVAILABLE"})
            return
        super().do_POST()


@pytest.mark.parametrize(("late", "busy"), [(3, 0), (0, 4)])
def test_a_slow_or_busy_server_loses_no_value(environment, caplog, monkeypatch, late: int, busy: int) -> None:
    """More slow answers in a row than a down server's attempts: every value arrives, once (MLflow stores a
    metric sent twice once: the same key, step, time and value), and nothing is reported lost."""
    Recorder.batches, SlowThenFine.late, SlowThenFine.busy = [], late, busy
    caplog.set_level(logging.WARNING, logger="training.run.tracking")
    monkeypatch.setattr(tracking, "REQUEST_TIMEOUT_S", 0.3)
    monkeypatch.setattr(tracking, "RETRY_WAIT_S", 0.05)
    with serving(SlowThenFine) as uri:
        environment(uri)
        settings = SimpleNamespace(lr=0.1)
        tracking.start(settings)
        for step in range(1, 51):
            tracking.metrics(step, {"train/loss": 1.0 / step})
        tracker = tracking._tracker
        tracking.finish(settings, {"steps": 50})
    sent = {(m["key"], m["step"], m["timestamp"]) for batch in Recorder.batches for m in batch["metrics"]}
    assert sorted(step for key, step, _ in sent if key == "train/loss") == list(range(1, 51))
    assert tracker is not None and tracker.dropped == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("is slow or busy" in w for w in warnings) == 1 and any("takes values again" in w for w in warnings)
    assert not any("not recorded" in w or "dropping" in w for w in warnings), warnings


def test_the_sender_recovers_when_the_server_comes_back(environment, caplog) -> None:
    Recorder.batches = []
    caplog.set_level(logging.WARNING, logger="training.run.tracking")
    client = tracking.MlflowRest(closed_port(), None)
    tracker = tracking.Tracker(client, "abc")
    tracker.metrics(1, {"train/loss": 1.0})
    wait_until(lambda: tracker.dropped == 1)
    with serving(Recorder) as uri:
        client.uri = uri
        tracker.metrics(2, {"train/loss": 0.5})
        tracker.finish(wait_s=10)
    sent = [m["step"] for batch in Recorder.batches for m in batch["metrics"]]
    assert sent == [2] and tracker.dropped == 1
    assert any("takes values again" in r.getMessage() for r in caplog.records)


@contextmanager
def _nothing(uri: str) -> Iterator[str]:
    yield uri


def wait_until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)
