"""Live experiment tracking: rank 0 sends a run's parameters, curves and final model to MLflow.

Runs inside the training job (on the nodes, in the framework images). Enabled when the job's
environment names a tracking server and a run: ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID`` (the
batch script creates the run, dtrain/remote/job/mlflow_run.py); ``MLFLOW_TRACKING_TOKEN``, when set, is
sent as a bearer token (an Azure ML workspace's MLflow endpoint), and never logged.

The client is MLflow's REST API over the standard library, not the ``mlflow`` package: mlflow-skinny
3.17.2 brings 44 packages (142 MB: FastAPI, uvicorn, the Databricks SDK, OpenTelemetry) into an image
whose TensorFlow pins protobuf below 5, and ``import mlflow`` alone takes 3 to 4 s here. Four
endpoints are all a job needs: runs/log-batch, runs/get, and the artifact proxy's PUT.

Training never waits for the server: the loop's log points put their values in a bounded buffer that a
background thread sends in batches. A server that is only slow or busy (a request that times out, HTTP
429 or 5xx: MLflow's SQLite store under load) keeps its batch: it is sent again, with a growing pause,
until it is taken (log-batch is idempotent: a metric of the same key, step, time and value is stored once),
while new values wait in the buffer. Values are dropped, with one warning per outage, only when the server
is down (the connection is refused or unreachable, a few attempts in a row), refuses the batch (another
4xx), or the buffer is full. At the end the job gives the thread a bounded time to send what is left and
the model; a dead or hung server costs a run at most that, and the job says how many values were lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import queue
import resource
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BUFFER = 20000  # log points held for the sender (an hour of every-step logging at 5 steps/s); past that, dropped
ATTEMPTS = 3  # per request to a server that is down, while it answered last time; one while it stays down
RETRY_WAIT_S = 0.5  # before the 2nd attempt, doubled before each next one
MAX_RETRY_WAIT_S = 10.0  # the longest pause between two attempts at a slow server
# A loaded head node (or the local cluster on 2 busy cores) takes seconds to commit a batch to SQLite:
# a short timeout would turn a slow answer into a lost one
REQUEST_TIMEOUT_S = 30.0
BUSY_STATUS = {429, 500, 502, 503, 504}  # the server is there and will take the batch later
FINISH_WAIT_S = 30.0  # the most a job's end waits for the sender (what is left, and the model)
BATCH_METRICS = 1000  # MLflow's limit per log-batch request
BATCH_PARAMS = 100
PARAM_CHARS = 6000  # MLflow's limit on a parameter's value

_tracker: Tracker | None = None


class TrackingError(Exception):
    """A request the server refused or did not answer; ``slow``: it is there, only slow or busy (a timeout,
    HTTP 429 or 5xx), and the same request may succeed later."""

    def __init__(self, message: str, slow: bool = False) -> None:
        super().__init__(message)
        self.slow = slow


class MlflowRest:
    """The few MLflow REST calls a job makes, with the standard library."""

    def __init__(self, uri: str, token: str | None) -> None:
        self.uri = uri.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, endpoint: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        data = None
        if method == "GET" and body:
            url += "?" + urllib.parse.urlencode(body)
        elif body is not None:
            data = json.dumps(body).encode()
        return json.loads(self._send(urllib.request.Request(url, data, self._headers, method=method)) or b"{}")

    def put_artifact(self, artifact_path: str, payload: bytes) -> None:
        """Upload through the server's artifact proxy (``mlflow server`` serves artifacts by default): the
        job needs no credential for the artifact store."""
        url = f"{self.uri}/api/2.0/mlflow-artifacts/artifacts/{urllib.parse.quote(artifact_path)}"
        headers = {**self._headers, "Content-Type": "application/octet-stream"}
        self._send(urllib.request.Request(url, payload, headers, method="PUT"))

    def _send(self, request: urllib.request.Request) -> bytes:
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.read()
        except urllib.error.HTTPError as exc:  # the body says why (MLflow's error_code and message)
            detail = exc.read()[:300].decode(errors="replace")
            what = f"HTTP {exc.code} from {request.full_url.split('?')[0]}: {detail}"
            raise TrackingError(what, slow=exc.code in BUSY_STATUS) from None
        except (OSError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise TrackingError(f"{self.uri}: {exc}", slow=isinstance(reason, TimeoutError)) from None


class Tracker:
    """Rank 0's sender: a bounded buffer and the thread that empties it into one MLflow run."""

    def __init__(self, client: MlflowRest, run_id: str, buffer: int | None = None) -> None:
        self.client, self.run_id = client, run_id
        self.dropped = 0  # values lost: a full buffer, a batch the server refused, or left at the end
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(BUFFER if buffer is None else buffer)
        self._failing = False  # the server was down at the last request: the next gets one attempt, not ATTEMPTS
        self._warned = False  # this outage was reported
        self._slow_warned = False  # this slow spell was reported
        self._thread = threading.Thread(target=self._send_all, name="mlflow-tracking", daemon=True)
        self._thread.start()

    def params(self, values: Mapping[str, Any]) -> None:
        self._put("params", [{"key": key, "value": str(value)[:PARAM_CHARS]} for key, value in values.items()])

    def metrics(self, step: int, values: Mapping[str, float | None]) -> None:
        now = int(time.time() * 1000)
        present = [
            {"key": key, "value": float(value), "timestamp": now, "step": step}
            for key, value in values.items()
            if value is not None and math.isfinite(value)  # JSON has no NaN: a diverged loss is in the log
        ]
        if present:
            self._put("metrics", present)

    def model(self, directory: Path) -> None:
        self._put("model", directory)

    def finish(self, wait_s: float | None = None) -> None:
        """Send what is buffered, within ``wait_s`` (FINISH_WAIT_S); after that the thread is left behind (a
        daemon), and what it still held counts as lost."""
        wait_s = FINISH_WAIT_S if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=wait_s)
        self._thread.join(max(deadline - time.monotonic(), 0))
        if self._thread.is_alive():
            self.dropped += self._left()
            log.warning("MLflow: gave up after %.0fs on %s; the run's last values are lost", wait_s, self.client.uri)
        if self.dropped:
            log.warning("MLflow: %d values were not recorded (server down, or still busy at the end)", self.dropped)

    def _left(self) -> int:
        """The values still in the buffer (the sender's current batch aside)."""
        with self._queue.mutex:
            entries = list(self._queue.queue)
        return sum(len(item) if isinstance(item, list) else 1 for _, item in filter(None, entries))

    def _put(self, kind: str, item: Any) -> None:
        try:
            self._queue.put_nowait((kind, item))
        except queue.Full:
            self._drop(len(item) if isinstance(item, list) else 1, "the buffer is full")

    def _send_all(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            kind, item = entry
            if kind == "model":
                self._deliver(len(list(_files(item))) or 1, functools.partial(self._upload, item))
                continue
            metrics, params = (item, []) if kind == "metrics" else ([], item)
            if kind == "metrics":  # everything else waiting, in one request
                metrics = [*metrics, *self._more_metrics(BATCH_METRICS - len(metrics))]
            for start in range(0, max(len(params), 1), BATCH_PARAMS):
                chunk = params[start : start + BATCH_PARAMS]
                body = {"run_id": self.run_id, "metrics": metrics, "params": chunk}
                send = functools.partial(self.client.call, "POST", "runs/log-batch", body)
                self._deliver(len(metrics) + len(chunk), send)
                metrics = []

    def _more_metrics(self, room: int) -> Iterator[dict[str, Any]]:
        while room > 0:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                return
            if entry is None or entry[0] != "metrics" or len(entry[1]) > room:
                self._queue_front(entry)
                return
            room -= len(entry[1])
            yield from entry[1]

    def _queue_front(self, entry: tuple[str, Any] | None) -> None:
        with self._queue.mutex:  # back where it was: the next one out
            self._queue.queue.appendleft(entry)
            self._queue.unfinished_tasks += 1

    def _deliver(self, count: int, send: Callable[[], object]) -> None:
        """Send until it is taken; a slow server's batch is never dropped (the buffer behind it is bounded)."""
        attempts, attempt = (1 if self._failing else ATTEMPTS), 0
        while True:
            try:
                send()
            except Exception as exc:  # an odd answer, an unreadable file: a drop, never the sender's end
                slow = isinstance(exc, TrackingError) and exc.slow
                attempt += 1
                if slow:
                    self._report_slow(exc)
                elif attempt >= attempts:
                    self._failing = True
                    self._drop(count, str(exc))
                    return
                time.sleep(min(RETRY_WAIT_S * 2 ** (attempt - 1), MAX_RETRY_WAIT_S))
                continue
            if self._warned or self._slow_warned:
                log.warning("MLflow: %s takes values again; tracking resumed", self.client.uri)
            self._failing = self._warned = self._slow_warned = False
            return

    def _report_slow(self, error: Exception) -> None:
        if not self._slow_warned:
            log.warning(
                "MLflow: %s is slow or busy, values wait in the buffer (training goes on): %s", self.client.uri, error
            )
            self._slow_warned = True

    def _drop(self, count: int, why: str) -> None:
        """One warning per outage (a server that fails, or one too slow for the buffer), not per value."""
        if not self._warned:
            log.warning("MLflow: dropping values until %s answers (training goes on): %s", self.client.uri, why)
            self._warned = True
        self.dropped += count

    def _upload(self, directory: Path) -> None:
        run = self.client.call("GET", "runs/get", {"run_id": self.run_id})["run"]["info"]
        root = _proxied_root(run["artifact_uri"])
        for path in _files(directory):
            self.client.put_artifact(f"{root}/model/{path.relative_to(directory).as_posix()}", path.read_bytes())


def _proxied_root(artifact_uri: str) -> str:
    """The run's artifact root as the proxy's path: ``mlflow-artifacts:/1/<run>/artifacts`` or its
    ``mlflow-artifacts://host:port/...`` form -> ``1/<run>/artifacts``."""
    scheme = "mlflow-artifacts:"
    if not artifact_uri.startswith(scheme):
        raise TrackingError(f"the server does not proxy artifacts (the run's artifact root is {artifact_uri})")
    path = urllib.parse.urlparse(artifact_uri).path
    return path.strip("/")


def _files(directory: Path) -> Iterator[Path]:
    return (path for path in sorted(directory.rglob("*")) if path.is_file())


def flat_params(settings: object) -> dict[str, Any]:
    """The settings object's fields, as MLflow parameters (unset ones left out)."""
    fields = dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else vars(settings)
    return {key: value for key, value in fields.items() if value is not None}


def start(settings: object) -> None:
    """On rank 0, when the environment names a server and a run: start sending, beginning with the
    settings. Elsewhere every call of this module does nothing."""
    global _tracker
    uri, run_id = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_RUN_ID")
    if not uri or not run_id or not uri.startswith(("http://", "https://")):
        return
    _tracker = Tracker(MlflowRest(uri, os.environ.get("MLFLOW_TRACKING_TOKEN")), run_id)
    _tracker.params(flat_params(settings))
    log.info("MLflow: logging to run %s at %s", run_id, uri)


def enabled() -> bool:
    """Whether this job's run is tracked (the same answer on every rank: it reads the job's environment)."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI") and os.environ.get("MLFLOW_RUN_ID"))


def metrics(step: int, values: Mapping[str, float | None]) -> None:
    if _tracker is not None:
        # this process's peak resident memory so far (ru_maxrss is in KiB on Linux)
        rss = {"memory/rank0_host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        _tracker.metrics(step, {**values, **rss})


def finish(settings: object, result: object) -> None:
    """The run's final numbers (``final/<key>`` of the metrics dict the job returns, MFU among them) and
    its exported model (``--export-dir``, under the run's ``model/`` artifacts); then the bounded wait."""
    global _tracker
    tracker, _tracker = _tracker, None
    if tracker is None:
        return
    if isinstance(result, Mapping):
        numbers = {f"final/{key}": value for key, value in result.items() if _is_number(value)}
        tracker.metrics(int(result.get("steps") or 0), numbers)
    export = getattr(settings, "export_dir", None)
    if export is not None and Path(export).is_dir():
        tracker.model(Path(export))
    tracker.finish()


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
