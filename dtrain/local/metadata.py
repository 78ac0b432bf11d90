"""Azure's instance metadata service on the local cluster: Scheduled Events, served for real.

Every node namespace has 169.254.169.254 on its loopback, and there, on port 80, this server (started
by `local up` in the node's network namespace only: like Azure's, it is not part of the machine and
outlives the node being switched off). It answers what the node agent (dtrain/remote/boot/spot_agent.py)
asks Azure, with Azure's JSON:

  GET  /metadata/scheduledevents?api-version=2020-07-01          (header Metadata: true) the events
  POST /metadata/scheduledevents?api-version=2020-07-01          {"StartRequests": [{"EventId": ...}]}
  GET  /metadata/instance/compute/name?api-version=2021-02-01&format=text   the VM's name (the node's)

The events are the cluster's, STATE/metadata/events.json, the same document for every node (Azure
delivers a scale set's events to all of its VMs; each event names the VMs it affects). A test makes
one announce a `Preempt` with :func:`announce_preempt` (the operator: `dtrain local preempt NODE`,
through :func:`preempt`, which refuses a node the cluster does not have); the affected node's server
then plays the platform: once the event is acknowledged (EventStatus `Started`) or its NotBefore has
passed, it switches the node off (dtrain/local/power.py) and removes the event. An event that no
server removed (its node's server was gone) expires EVENT_EXPIRY_S after its NotBefore, as Azure's do.

  python -m dtrain.local.metadata --state-dir STATE serve node-0        # what `up` starts per node
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime, parsedate_to_datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dtrain.cli_entry import CLIParser, non_empty, run_cli
from dtrain.errors import OperatorError
from dtrain.local import power as local_power
from dtrain.local.state import load_state

METADATA_ADDRESS = "169.254.169.254"  # Azure's, link-local: it exists only inside the node namespaces
EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"
PREEMPT_NOTICE_S = 30  # Azure's minimum notice for a Spot eviction
EVENT_EXPIRY_S = 300  # a Preempt still listed this long after its NotBefore is dropped
EVICTION_CHECK_S = 0.5
log = logging.getLogger("local-metadata")


def metadata_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "metadata"


@contextmanager
def events_document(state_dir: Path) -> Iterator[dict[str, Any]]:
    """The cluster's events, read and (when the caller changed them) written back under a lock."""
    directory = metadata_dir(state_dir)
    directory.mkdir(exist_ok=True)
    path = directory / "events.json"
    with open(directory / "events.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        document = json.loads(path.read_text()) if path.exists() else {"DocumentIncarnation": 0, "Events": []}
        before = json.dumps(document, sort_keys=True)
        document["Events"] = [event for event in document["Events"] if not _expired(event)]
        yield document
        if json.dumps(document, sort_keys=True) != before:
            document["DocumentIncarnation"] += 1
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(document, indent=2))
            tmp.replace(path)


def _expired(event: dict[str, Any]) -> bool:
    expiry = parsedate_to_datetime(event["NotBefore"]) + timedelta(seconds=EVENT_EXPIRY_S)
    return expiry <= datetime.now(UTC)


def preempt(state_dir: str | Path, node: str, notice_s: int = PREEMPT_NOTICE_S) -> str:
    """The operator's announcement: a Preempt of one of the cluster's Slurm nodes; returns the event's id."""
    state_dir = Path(state_dir).resolve()
    state = load_state(state_dir)
    if state is None:
        raise OperatorError(f"no local cluster recorded in {state_dir} (--state-dir names the one `local up` made)")
    names = [known.hostname for known in state.nodes]
    if node not in names or state.slurm_conf is None:
        have = f"its nodes are {', '.join(names)}" if state.slurm_conf else "it has no Slurm (localhost mode)"
        raise OperatorError(f"no node {node!r} to evict in the local cluster in {state_dir}: {have}")
    return announce_preempt(state_dir, node, notice_s)


def announce_preempt(state_dir: str | Path, node: str, notice_s: int = PREEMPT_NOTICE_S) -> str:
    """Announce that Azure evicts the Spot VM `node` in notice_s seconds; returns the event's id."""
    event_id = str(uuid.uuid4()).upper()
    not_before = datetime.now(UTC) + timedelta(seconds=notice_s)
    with events_document(Path(state_dir)) as document:
        document["Events"].append(
            {
                "EventId": event_id,
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": [node],
                "EventStatus": "Scheduled",
                "NotBefore": format_datetime(not_before, usegmt=True),
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )
    return event_id


def acknowledge(state_dir: Path, event_ids: Sequence[str]) -> None:
    with events_document(state_dir) as document:
        for event in document["Events"]:
            if event["EventId"] in event_ids:
                event["EventStatus"] = "Started"


def evict_when_due(state_dir: Path, node: str, power_off: Callable[[Path, str], object]) -> None:
    """The platform's side: a Preempt of `node` that was acknowledged or reached NotBefore switches it off."""
    now = datetime.now(UTC)
    with events_document(state_dir) as document:
        due = [
            event
            for event in document["Events"]
            if node in event["Resources"]
            and (event["EventStatus"] == "Started" or parsedate_to_datetime(event["NotBefore"]) <= now)
        ]
        if not due:
            return
        document["Events"] = [event for event in document["Events"] if event not in due]
    log.info("evicting %s (events %s)", node, ", ".join(event["EventId"] for event in due))
    power_off(state_dir, node)


class MetadataHandler(BaseHTTPRequestHandler):
    server: MetadataServer

    def do_GET(self) -> None:
        path = self._checked_path()
        if path == EVENTS_PATH:
            with events_document(self.server.state_dir) as document:
                self._reply(HTTPStatus.OK, json.dumps(document).encode(), "application/json")
        elif path == NAME_PATH:
            self._reply(HTTPStatus.OK, self.server.node.encode(), "text/plain")
        elif path is not None:
            self._error(HTTPStatus.NOT_FOUND, "Not found")

    def do_POST(self) -> None:
        path = self._checked_path()
        if path is None:
            return
        if path != EVENTS_PATH:
            self._error(HTTPStatus.NOT_FOUND, "Not found")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            ids = [request["EventId"] for request in body["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            self._error(HTTPStatus.BAD_REQUEST, "Bad request. StartRequests expected")
            return
        acknowledge(self.server.state_dir, ids)
        self._reply(HTTPStatus.OK, b"", "application/json")

    def _checked_path(self) -> str | None:
        """The path, or None after answering 400 as Azure does (no Metadata header, no api-version)."""
        url = urlsplit(self.path)
        if self.headers.get("Metadata", "").lower() != "true":
            self._error(HTTPStatus.BAD_REQUEST, "Bad request. Required metadata header not specified")
            return None
        if "api-version" not in parse_qs(url.query):
            self._error(HTTPStatus.BAD_REQUEST, "Bad request. api-version was not specified in the request")
            return None
        return url.path

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._reply(status, json.dumps({"error": message}).encode(), "application/json")

    def _reply(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)


class MetadataServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state_dir: Path, node: str, address: str = METADATA_ADDRESS, port: int = 80) -> None:
        super().__init__((address, port), MetadataHandler)
        self.state_dir, self.node = state_dir, node


def serve(state_dir: Path, node: str) -> None:
    server = MetadataServer(state_dir, node)

    def platform() -> None:
        while True:
            try:
                evict_when_due(state_dir, node, local_power.stop_node)
            except Exception:  # the server goes on: a failed eviction is tried again
                log.exception("evicting %s failed", node)
            time.sleep(EVICTION_CHECK_S)

    threading.Thread(target=platform, name="platform", daemon=True).start()
    log.info("serving %s's metadata on %s:80", node, METADATA_ADDRESS)
    server.serve_forever()


def _run(args: argparse.Namespace) -> int:
    serve(Path(args.state_dir).resolve(), args.node)
    return 0


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="python -m dtrain.local.metadata",
        description="Serve a local node's instance metadata (Azure Scheduled Events); `local up` starts one per "
        "node. To announce an eviction: dtrain local preempt NODE.",
        epilog="example: python -m dtrain.local.metadata --state-dir STATE serve node-0",
    )
    parser.add_argument("--state-dir", type=non_empty, required=True, help="the local cluster's state directory")
    parser.add_argument("action", choices=("serve",), help="serve the node's endpoint")
    parser.add_argument("node", help="the node (its hostname)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s", level=logging.INFO)
    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":  # what `local up` starts in each node's namespace
    raise SystemExit(main())
