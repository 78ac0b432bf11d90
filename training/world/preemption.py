"""Spot evictions, job side: SIGUSR1 means "save a checkpoint at the next step boundary, then stop".

The job script sends the same signal shortly before the job's time limit (`launch --warn-before`).

When Azure announces that a Spot node will be evicted, the node agent (dtrain/remote/boot/spot_agent.py)
sends SIGUSR1 to the job's ranks on that node (the job's processes there that catch it); srun may
forward it to others, which the batch script and the launchers ignore (job.sh sets that up). Every
rank records it here.

Ranks see the signal at different moments, possibly in different steps, so they agree before they
act: at every step boundary each rank starts a one-integer "has any rank been signalled?" reduction
on a CPU channel of its own (Horovod's background thread, or a gloo group beside NCCL), and reads the
result of the *previous* boundary's reduction, which finished long ago. No rank waits for the device
or for its peers in the step loop, and every rank reads the same answer at the same boundary: there
the job saves a checkpoint (where it keeps them) and every rank exits with ``ExitCode.PREEMPTED``
(75). A rank that is frozen never votes, so its peers block at that boundary until the agent gives
up and has Slurm requeue the job, which then resumes from the checkpoint before.

A rank's data workers ignore it (:func:`ignore`): a forwarded signal must not end them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from training.errors import Preempted

PREEMPT_SIGNAL = signal.SIGUSR1
_signalled: list[int] = []  # written by the handler: appending is safe in a signal handler


class Voter(Protocol):
    def start_vote(self, flag: bool) -> Callable[[], bool]:
        """Start a reduction of every rank's ``flag`` (any rank True: True) without waiting for it;
        the returned function waits for it and returns the result (collective: every rank calls both)."""
        ...


def install() -> None:
    """Record SIGUSR1 from now on (the main thread of every rank, before the backend starts)."""
    signal.signal(PREEMPT_SIGNAL, _record)


def ignore() -> None:
    """For helper processes of a rank (data workers): the signal is for the rank, not them."""
    signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)


def signalled() -> bool:
    return bool(_signalled)


def _record(signum: int, frame: FrameType | None) -> None:
    _signalled.append(signum)


class PreemptionWatch:
    """The agreement at step boundaries. Every rank makes one and calls :meth:`agreed` at each boundary."""

    def __init__(self, voter: Voter) -> None:
        self._voter = voter
        self._pending: Callable[[], bool] | None = None

    def agreed(self) -> bool:
        """True on every rank at the same boundary once any rank was signalled (by the boundary before)."""
        decided = self._pending() if self._pending is not None else False
        self._pending = None if decided else self._voter.start_vote(signalled())
        return decided

    def close(self) -> None:
        """Finish the outstanding vote (before the backend shuts down)."""
        if self._pending is not None:
            self._pending()
            self._pending = None


def stop(step: int, saved: bool) -> Preempted:
    """The error every rank raises once they agreed to stop after ``step``."""
    kept = (
        f"saved the checkpoint of step {step}; a requeued job resumes from it"
        if saved
        else "no --checkpoint-dir, nothing saved: a requeued job starts from step 0"
    )
    why = "SIGUSR1: a Spot eviction, or the time limit's warning"  # dtrain/jobs/time_warning.py
    return Preempted(f"preempted ({why}) after step {step}: {kept}", every_rank=True)
