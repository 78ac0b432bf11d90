"""What the jobs need from a communication backend, and the settings that bound a failure.

A dead or hung worker must end the job with a non-zero exit, never leave it waiting:

* a worker process that exits (crash, SIGKILL, OOM) is seen at once by ``horovodrun`` and
  ``torchrun``, which stop the other workers and exit non-zero;
* a worker that is alive but stuck (hung file system, wedged GPU) is caught by Horovod's
  stall inspector: after ``HOROVOD_STALL_CHECK_TIME_SECONDS`` it logs which ranks are
  missing, after ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` it shuts Horovod down and the job
  fails;
* a peer whose host disappears fails gloo operations after ``HOROVOD_GLOO_TIMEOUT_SECONDS``;
* DDP collectives time out after ``DDP_TIMEOUT_SECONDS``.

:func:`set_failure_timeouts` fills in these defaults before the backend starts; values set
by the user (environment, or horovodrun's ``--stall-check-*`` / ``--gloo-timeout-seconds``
flags, which set the same variables) win.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

FAILURE_TIMEOUTS = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
    # Longer than a checkpoint save or a slow first step, short enough to free the cluster.
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "30",
    "DDP_TIMEOUT_SECONDS": "120",
}


def set_failure_timeouts(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Apply :data:`FAILURE_TIMEOUTS` where unset; return the values in effect."""
    for name, value in FAILURE_TIMEOUTS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in FAILURE_TIMEOUTS}


class Dist(Protocol):
    """The collective operations the framework-neutral code uses (all ranks must call them)."""

    backend: str
    rank: int
    size: int
    local_rank: int
    local_size: int

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        ...

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        ...

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank, as one tensor broadcast.

        For checkpoints: the object broadcasts pickle into a tensor element by element,
        which takes minutes for a ResNet-50 checkpoint.
        """
        ...
