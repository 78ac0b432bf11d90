"""What the jobs need from a communication backend, and the settings that bound a failure.

A dead or hung worker must end the job with a non-zero exit, never leave it waiting. One bound
covers every way a rank can stop answering, in both backends: 60 s (``PEER_TIMEOUT_SECONDS``).

* a worker process that exits (crash, SIGKILL, OOM) is seen at once by ``horovodrun`` and
  ``torchrun``, which stop the other workers and exit non-zero;
* a worker that is frozen or cut off (SIGSTOP, a hung node, a network partition) stops taking
  part in gloo's operations: Horovod's background thread negotiates over gloo every cycle, so
  its peers fail after ``HOROVOD_GLOO_TIMEOUT_SECONDS``; DDP's collectives fail after
  ``DDP_TIMEOUT_SECONDS``;
* a worker that is alive but stuck before a collective (a hung file system read, a wedged GPU)
  still negotiates, so with Horovod the stall inspector catches it: it warns after
  ``HOROVOD_STALL_CHECK_TIME_SECONDS`` and shuts Horovod down after
  ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (checked every stall-check period); with DDP the
  peers' collective times out as above.

The same 60 s also bounds a pause of rank 0 alone, its share of evaluation, while the others wait
(a checkpoint's file is written beside training: training/checkpoint/writer.py).
:mod:`training.world.liveness` then names the rank that stopped answering.

:func:`set_failure_timeouts` fills in these defaults before the backend starts; values set
by the user (environment, or horovodrun's ``--stall-check-*`` / ``--gloo-timeout-seconds``
flags, which set the same variables) win.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol, TypeVar

from training.errors import BadInput

T = TypeVar("T")

PEER_TIMEOUT_SECONDS = 60
FAILURE_TIMEOUTS = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": str(PEER_TIMEOUT_SECONDS // 2),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(PEER_TIMEOUT_SECONDS),
    "HOROVOD_GLOO_TIMEOUT_SECONDS": str(PEER_TIMEOUT_SECONDS),
    "DDP_TIMEOUT_SECONDS": str(PEER_TIMEOUT_SECONDS),
}


def set_failure_timeouts(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Apply :data:`FAILURE_TIMEOUTS` where unset; return the values in effect."""
    for name, value in FAILURE_TIMEOUTS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in FAILURE_TIMEOUTS}


def peer_timeout_seconds(backend: str, env: Mapping[str, str] = os.environ) -> float | None:
    """How long a collective of ``backend`` waits for a silent peer before it fails (None: unknown)."""
    name = {"horovod": "HOROVOD_GLOO_TIMEOUT_SECONDS", "ddp": "DDP_TIMEOUT_SECONDS"}.get(backend)
    try:
        return float(env[name]) if name else None
    except (KeyError, ValueError):
        return None


# A rank other than 0 that meets an error every rank meets leaves the report to rank 0, and
# lets rank 0 exit first: launchers stop the others at the first exit and report that one.
QUIET_RANK_DELAY_SECONDS = 10.0


def launcher_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher set it (horovodrun, torchrun), before a backend starts."""
    return int(env.get("HOROVOD_RANK", env.get("RANK", "0")))


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

    def start_vote(self, flag: bool) -> Callable[[], bool]:
        """Start "is any rank's ``flag`` True?" without waiting (one integer, on a CPU channel that
        never waits for the device); the returned function waits for the answer (see training.world.preemption)."""
        ...


class Backend(Dist, Protocol):
    """A job's backend: the collectives, how it stops, and the errors that mean a collective failed."""

    failures: tuple[type[BaseException], ...]

    def shutdown(self) -> None:
        """Stop the backend's threads cleanly (a finished run only: every rank calls it)."""
        ...


def agree(dist: Dist, check: Callable[[], T]) -> T:
    """Run ``check`` on every rank; if it refuses the input on any rank, every rank raises the
    first refusal (so rank 0 reports it once, and no rank goes on to wait for the others)."""
    problem = None
    try:
        result = check()
    except BadInput as exc:
        problem = (type(exc), str(exc))
    for rank, refusal in enumerate(dist.allgather_object(problem)):
        if refusal is not None:
            kind, message = refusal
            raise kind(message if rank == 0 else f"rank {rank}: {message}", every_rank=True)
    return result
