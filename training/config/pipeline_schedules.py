"""Pipeline schedules by name, and what each asks of a layout: stages per rank, microbatches, its bubble.

Framework-free, so that the parser can check ``--pp``, ``--pp-schedule`` and ``--microbatches`` before
torch is imported; the schedules themselves run in training/torch/parallel/pipeline.py.

Runs wherever a job runs. Standard library only.
"""

from __future__ import annotations

from training.errors import BadInput

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
DEFAULT_VIRTUAL_STAGES = 2


def stages_per_rank(schedule: str, virtual_stages: int | None = None) -> int:
    """How many stages each rank holds: 1, or ``virtual_stages`` (default 2) for interleaved-1f1b."""
    check_schedule(schedule)
    if schedule != "interleaved-1f1b":
        return 1
    v = DEFAULT_VIRTUAL_STAGES if virtual_stages is None else virtual_stages
    if v < 2:
        raise BadInput(f"interleaved-1f1b needs at least 2 stages per rank, got {v}")
    return v


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise BadInput(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def check_microbatches(microbatches: int, pp: int, schedule: str, batch_size: int | None = None) -> None:
    """Refuse a microbatch count the schedule cannot run, with the flag to change (call before any
    process group starts)."""
    check_schedule(schedule)
    if microbatches < 1:
        raise BadInput(f"--microbatches must be at least 1, got {microbatches}")
    if schedule == "1f1b" and microbatches < pp:
        raise BadInput(f"--pp-schedule 1f1b needs --microbatches >= --pp ({pp}), got {microbatches}")
    # Megatron's constraint, stricter than torch's (a multiple of the rounds): it keeps every
    # round of the interleaved schedule full.
    if schedule == "interleaved-1f1b" and microbatches % pp:
        raise BadInput(
            f"--pp-schedule interleaved-1f1b needs --microbatches a multiple of --pp ({pp}), got {microbatches}"
        )
    # Unequal microbatches would weigh samples unequally in the mean of microbatch means.
    if batch_size is not None and batch_size % microbatches:
        raise BadInput(f"--batch-size {batch_size} must be a multiple of --microbatches {microbatches}")


def theoretical_bubble(pp: int, microbatches: int, schedule: str = "gpipe", virtual_stages: int | None = None) -> float:
    """The idle share of a pipeline of equal stages with free communication: (p-1)/(v m + p-1)."""
    v = stages_per_rank(schedule, virtual_stages)
    return (pp - 1) / (v * microbatches + pp - 1)
