"""Waiting for a condition with a deadline, shared by the suites of both environments."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll until ``condition()`` is truthy and return that value; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
