"""Slurm's --time syntax, read the way sbatch reads it: the job time limits of launch, alloc and the
cluster description's default."""

from __future__ import annotations

import re

from scripts.errors import OperatorError

# Slurm's --time: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES,
# DAYS-HOURS:MINUTES:SECONDS (sbatch(1)); "UNLIMITED" and 0 are refused: every job ends.
_TIME_FORMS = (
    (re.compile(r"(\d+)"), ("m",)),
    (re.compile(r"(\d+):(\d+)"), ("m", "s")),
    (re.compile(r"(\d+):(\d+):(\d+)"), ("h", "m", "s")),
    (re.compile(r"(\d+)-(\d+)"), ("d", "h")),
    (re.compile(r"(\d+)-(\d+):(\d+)"), ("d", "h", "m")),
    (re.compile(r"(\d+)-(\d+):(\d+):(\d+)"), ("d", "h", "m", "s")),
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm --time value; anything Slurm would not read, or zero, is refused."""
    for pattern, units in _TIME_FORMS:
        match = pattern.fullmatch(text.strip())
        if match:
            seconds = sum(int(value) * _SECONDS[unit] for value, unit in zip(match.groups(), units, strict=True))
            if seconds <= 0:
                break
            return seconds
    raise OperatorError(
        f"invalid time limit {text!r}: use Slurm's --time syntax, e.g. 90 (minutes), 4:00:00, 2-00:00:00 (and not 0)"
    )


def check_time_limit(text: str) -> str:
    time_limit_seconds(text)
    return text.strip()
