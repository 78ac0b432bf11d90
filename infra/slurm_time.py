"""Slurm's time syntax, read the way sbatch and slurm.conf read it: the stack's job time limits
(defaultJobTime, maxJobTime) and the operator's (`launch --time`, the cluster description's).

Standard library only, so that the CLI (dtrain/cluster/slurm_time.py) reads times with the same rules.
Errors are ValueErrors whose text says what is allowed; each caller names the value and where it came from.
"""

from __future__ import annotations

import re

# The time limit of a job that names none, unless the stack says otherwise (defaultJobTime): a
# forgotten job on eight H100s costs about $2,400 a day at list price.
DEFAULT_JOB_TIME = "24:00:00"
# slurm.conf's word for no limit; Slurm reads UNLIMITED (any case) as the same.
UNLIMITED = "INFINITE"
_UNLIMITED_WORDS = frozenset({"INFINITE", "UNLIMITED"})
# Slurm's --time: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES,
# DAYS-HOURS:MINUTES:SECONDS (sbatch(1)).
_TIME_FORMS = (
    (re.compile(r"(\d+)"), ("m",)),
    (re.compile(r"(\d+):(\d+)"), ("m", "s")),
    (re.compile(r"(\d+):(\d+):(\d+)"), ("h", "m", "s")),
    (re.compile(r"(\d+)-(\d+)"), ("d", "h")),
    (re.compile(r"(\d+)-(\d+):(\d+)"), ("d", "h", "m")),
    (re.compile(r"(\d+)-(\d+):(\d+):(\d+)"), ("d", "h", "m", "s")),
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
TIME_SYNTAX = "Slurm's --time syntax, e.g. 90 (minutes), 4:00:00, 2-00:00:00 (and not 0)"
# The longest finite limit taken: a year. Slurm itself takes 8,000 years, which is a typo, not a plan;
# a job that truly must not end says INFINITE where the stack allows it (maxJobTime).
MAX_FINITE_DAYS = 365


def time_limit_seconds(text: str) -> int:
    """Seconds in a finite time limit; anything Slurm would not read, zero, or no limit at all is refused
    (every job ends)."""
    for pattern, units in _TIME_FORMS:
        match = pattern.fullmatch(text.strip())
        if match:
            seconds = sum(int(value) * _SECONDS[unit] for value, unit in zip(match.groups(), units, strict=True))
            if seconds > MAX_FINITE_DAYS * _SECONDS["d"]:
                raise ValueError(f"more than {MAX_FINITE_DAYS} days; use {TIME_SYNTAX}")
            if seconds > 0:
                return seconds
            break
    raise ValueError(f"use {TIME_SYNTAX}")


def is_unlimited(text: str) -> bool:
    return text.strip().upper() in _UNLIMITED_WORDS


def check_time_limit(text: str) -> str:
    """A finite time limit, as given (without surrounding blanks)."""
    time_limit_seconds(text)
    return text.strip()


def check_max_time(text: str) -> str:
    """A partition's longest job: a finite time limit, or INFINITE (also read: UNLIMITED)."""
    if is_unlimited(text):
        return UNLIMITED
    try:
        return check_time_limit(text)
    except ValueError:
        raise ValueError(f"use {TIME_SYNTAX}, or {UNLIMITED} (also UNLIMITED) for no limit") from None


def exceeds(limit: str, maximum: str) -> bool:
    """Whether a finite time limit is longer than a maximum (INFINITE: nothing is)."""
    return not is_unlimited(maximum) and time_limit_seconds(limit) > time_limit_seconds(maximum)
