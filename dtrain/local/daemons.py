"""Waiting for the daemons the local cluster starts, and saying why when one does not come up."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

from dtrain.errors import ExitCode, OperatorError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise OperatorError(
        f"{what} did not start listening on {host}:{port} within {timeout:.0f}s{log_tail(log)}", ExitCode.TIMED_OUT
    )


def http_answers(url: str, timeout: float) -> bool:
    """Poll ``url`` until it answers 2xx (True) or ``timeout`` seconds pass (False; 0: one try)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:  # refused, not yet listening, or an HTTP error status while it starts
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def wait_socket_file(path: Path, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while not path.is_socket():
        if time.time() > deadline:
            message = f"{what} did not create {path} within {timeout:.0f}s{log_tail(log)}"
            raise OperatorError(message, ExitCode.TIMED_OUT)
        time.sleep(0.05)


def log_tail(log: Path | None, lines: int = 15) -> str:
    """The last lines of a daemon's log, to append to an error message ('' when there is none)."""
    if log is None or not log.exists():
        return ""
    return f"\n--- {log} (last lines) ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
