"""The slow ranks of running jobs, as `jobs` and `status` show them. Runs on the operator's machine.

A bundled job's rank 0 keeps ``slow_ranks.json`` in its run directory (training/run/slow_ranks.py): the
ranks whose compute per step has stayed above 1.5 times the median of the others' (docs/operator.md,
"Slow ranks").
The login node's list_runs.py reads it with the rest of each run (one call per command) and leaves it out
when it is older than the attempt now running.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dtrain.cluster.slurm import QueuedJob
from dtrain.json_documents import SlowRankRow

if TYPE_CHECKING:  # dtrain.jobs.runs imports submit, which imports this module's file name
    from dtrain.jobs.runs import Run

SLOW_RANKS_FILE = "slow_ranks.json"  # in the run directory: `launch` gives our jobs --slow-ranks-json there


def rows_of(document: Mapping[str, Any] | None, job: str | None, run: str | None) -> list[SlowRankRow]:
    """The slow ranks a slow_ranks.json names (none for a document it cannot read: a report, not a failure)."""
    rows = []
    for entry in (document or {}).get("slow") or []:
        try:
            rows.append(SlowRankRow(job=job, run=run, **{key: entry.get(key) for key in _FIELDS}))
        except (TypeError, ValueError, AttributeError):
            continue
    return rows


_FIELDS = tuple(name for name in SlowRankRow.model_fields if name not in ("job", "run"))


def running_slow_ranks(queue: Sequence[QueuedJob], runs: Iterable[Run]) -> dict[str, list[SlowRankRow]]:
    """job id -> the slow ranks of each running job (those with any); the runs are matched by job id."""
    running = {job.job_id for job in queue if job.state == "RUNNING"}
    found = {}
    for run in runs:
        if run.job_id in running and run.slow_ranks:
            rows = rows_of(run.slow_ranks, run.job_id, run.run_id)
            if rows:
                found[run.job_id] = rows
    return found


def running_run_ids(queue: Sequence[QueuedJob]) -> list[str]:
    """The run ids of the running jobs (Slurm names a launched job after its run)."""
    return [job.name for job in queue if job.state == "RUNNING"]


def by_node(slow: Mapping[str, list[SlowRankRow]]) -> dict[str, list[SlowRankRow]]:
    """node -> the slow ranks running on it, of every job."""
    nodes: dict[str, list[SlowRankRow]] = {}
    for rows in slow.values():
        for row in rows:
            nodes.setdefault(row.host, []).append(row)
    return nodes


def describe(row: SlowRankRow) -> str:
    """`slow: rank 1 on node-1 (1.7x the median compute)`, in the note of a running job (--json: the figures)."""
    ratio = "" if row.ratio is None else f" ({row.ratio:.1f}x the median compute)"
    return f"slow: rank {row.rank} on {row.host}{ratio}"
