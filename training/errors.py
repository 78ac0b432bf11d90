"""The errors a job reports in one line, each with its status from the product's one exit-status table
(training/exit_status.py, re-exported here as ``ExitCode``; the operator CLI uses the same).
"""

from __future__ import annotations

from training.exit_status import ExitCode

__all__ = [
    "BadInput",
    "CheckpointRefused",
    "ExitCode",
    "JobError",
    "NotReady",
    "OutputPathError",
    "Preempted",
    "first_line",
]


class JobError(Exception):
    """A failure whose message says everything: printed as one ``error:`` line, no traceback.

    ``every_rank``: every rank raises this same error at the same point (a verdict that was
    broadcast or agreed), so rank 0 alone reports it.
    """

    exit_code = ExitCode.FAILED

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class BadInput(JobError):
    """The command or its files are wrong; the message says what to change."""

    exit_code = ExitCode.BAD_INPUT


class OutputPathError(BadInput):
    """An output path (checkpoint directory, metrics JSON) cannot be written, or its disk is full."""


class NotReady(JobError):
    """The environment lacks something the job needs (a package, a service); the message names it."""

    exit_code = ExitCode.NOT_READY


class Preempted(JobError):
    """Every rank agreed to stop for an eviction, after saving a checkpoint where the job keeps them."""

    exit_code = ExitCode.PREEMPTED


class CheckpointRefused(BadInput):
    """The checkpoint directory holds nothing this run may resume from."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (frameworks append pages of context)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
