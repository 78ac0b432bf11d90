"""Slurm's --time syntax for the CLI: the job time limits of launch, alloc and the cluster description,
read by infra/slurm_time.py's rules (the stack's defaultJobTime and maxJobTime use the same), refused
as an operator's error."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dtrain.errors import OperatorError
from infra import slurm_time

T = TypeVar("T")


def _read(rule: Callable[[str], T], text: str) -> T:
    try:
        return rule(text)
    except ValueError as exc:
        raise OperatorError(f"invalid time limit {text!r}: {exc}") from None


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm --time value; anything Slurm would not read, or zero, is refused."""
    return _read(slurm_time.time_limit_seconds, text)


def check_time_limit(text: str) -> str:
    """A finite time limit, as given (without surrounding blanks)."""
    return _read(slurm_time.check_time_limit, text)


def check_max_time(text: str) -> str:
    """The longest a job may run on a cluster: a time limit, or INFINITE."""
    return _read(slurm_time.check_max_time, text)
