"""`launch --warn-before`: a signal some minutes before the job's time limit, so that it saves a checkpoint.

The job is submitted with `sbatch --signal=B:USR1@SECONDS`: Slurm signals the batch script that long
before the limit (up to a minute earlier: it checks limits periodically), and the script passes
SIGUSR1 on to the training processes on every node of the job (dtrain/remote/job/time_warning.py, run
as a job step on each), the signal a Spot eviction sends: our jobs save a checkpoint at the next step
boundary and end; the user's own code may catch it.
A job that ends so is recorded as ended by its time limit (status.json `ended_by`, TIMEOUT in `jobs`).
"""

from __future__ import annotations

import re

from dtrain.cluster.slurm_time import time_limit_seconds
from dtrain.cluster.ssh import q
from dtrain.errors import OperatorError
from infra.contract import PREEMPTED_EXIT_CODE
from infra.slurm_time import is_unlimited

DEFAULT_S = 300  # long enough to write a large model's checkpoint, short against a training run
MAX_S = 65535  # sbatch --signal's largest
SLURM_EARLY_S = 60  # how much earlier than asked Slurm may send it
REPORT_BEFORE_END_S = 10  # each node's forwarder gives up that long before the limit, and reports
_LEAD = re.compile(r"(\d+)([smh]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_lead(text: str) -> int:
    """Seconds in a --warn-before value: 90, 90s, 5m or 1h; 0 turns the warning off."""
    match = _LEAD.fullmatch(text.strip())
    if not match:
        raise OperatorError(f"invalid --warn-before {text!r}: use seconds, or a number with s, m or h (90s, 5m, 1h)")
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > MAX_S:
        raise OperatorError(f"--warn-before {text} is too long: Slurm signals at most {MAX_S} s before the limit")
    return seconds


def warning_lead(asked: int | None, time_limit: str) -> int:
    """The lead for a job with this time limit: asked (checked against the limit), or the default, at
    most half the limit (a 1-minute job is warned 30 s before its end)."""
    limit = None if is_unlimited(time_limit) else time_limit_seconds(time_limit)
    if asked is None:
        return DEFAULT_S if limit is None else min(DEFAULT_S, limit // 2)
    if limit is not None and asked >= limit:
        raise OperatorError(
            f"--warn-before {asked}s is not shorter than the time limit ({time_limit}): "
            "pass a shorter one, or 0 for none"
        )
    return asked


def header(lead_s: int) -> list[str]:
    return [f"#SBATCH --signal=B:USR1@{lead_s}"] if lead_s else []


def trap(lead_s: int, every_node: str, container: str | None = None, python: str = "") -> list[str]:
    """After the launch started (which keeps USR1 ignored, see batch_script.IGNORING_USR1): the warning's
    trap. A Spot agent signals this shell too (it catches USR1 now): only a USR1 within the lead (and
    Slurm's minute) of the end counts as the time limit's. Slurm signals this shell alone: the forwarder
    runs on every node as one job step (every_node: srun, one task per node, its tasks ignoring USR1, so
    that this step's srun, which catches USR1 and passes it on to its tasks, harms nothing when a Spot
    agent signals it); on this node it skips this shell and that srun. With the docker runtime the ranks
    run as root in the job's container on each node, whose processes the job's user cannot read: the
    tool runs in there (docker exec, the image's python; the run directory is mounted).
    Slurm's signal may have come before this trap, while USR1 was still ignored (during the setup, a
    local copy or the gate: for a short limit Slurm sends it as the job starts), and is lost then: the
    trap's function runs once as it is installed, and passes the warning on if it is due by now (the
    window Slurm itself may send it in); Slurm's own signal after that finds it passed on already."""
    if not lead_s:
        return []
    if container:
        tool = f"docker exec -e SLURMD_NODENAME {container} {q(python)}"
        skip = ""  # this shell and the step's srun are not in the container
    else:
        tool, skip = '"$PY"', '--skip $$ --skip "$BASHPID" --skip-on "$SLURMD_NODENAME" '
    near = f'[ "$JOB_ENDS_AT" -gt 0 ] && [ "$(date +%s)" -ge $((JOB_ENDS_AT - {lead_s + SLURM_EARLY_S})) ] || return 0'
    say = f"[job] the time limit is {lead_s} s away or less: asking the job to save a checkpoint (SIGUSR1)"
    # until shortly before the limit (a slow start: the ranks may not catch it yet), so that every node
    # reports and the step ends before the limit ends the job; exec: $BASHPID is srun's
    within = f'"$((JOB_ENDS_AT - $(date +%s) - {REPORT_BEFORE_END_S}))"'
    forward = f'{tool} "$TOOLS/time_warning.py" --job "$SLURM_JOB_ID" {skip}--within {within}'
    summarize = '"$PY" "$TOOLS/time_warning.py" --summarize "$SLURM_JOB_NUM_NODES"'
    return [
        "# shellcheck disable=SC2317  # run by the USR1 trap",
        "time_warning() {",
        f"  {near}",
        '  [ -z "${TIME_WARNED:-}" ] || return 0',
        "  TIME_WARNED=1",
        f"  echo {q(say)}",
        f"  {{ exec {every_node} {forward}; }} | {summarize} &",
        "}",
        "trap time_warning USR1",
        "time_warning",
    ]


def wait_for_launch() -> list[str]:
    """Wait for the launch; a trapped signal interrupts `wait` (status > 128) while it still runs."""
    return [
        'until wait "$STEP_PID"; code=$?; [ "$code" -le 128 ] || ! kill -0 "$STEP_PID" 2>/dev/null; do :; done',
        '(exit "$code")',
    ]


# In finish(): our jobs end with 75 (PREEMPTED) after the warning's checkpoint: that is the time limit's doing
ENDED_BY_WARNING = f'  [ -n "${{TIME_WARNED:-}}" ] && [ "$code" -eq {PREEMPTED_EXIT_CODE} ] && ENDED_BY=time_limit'


# In the TERM trap: whether the attempt's time limit has come (Slurm checks limits about every 30 s and
# signals at or after EndTime; a cancel in the last 5 seconds before it would read as the limit's).
TIME_LIMIT_TEST = '[ "$JOB_ENDS_AT" -gt 0 ] && [ "$(date +%s)" -ge $((JOB_ENDS_AT - 5)) ]'
# A step that failed at the time limit was ended by it (Slurm ends the steps, and the batch shell's TERM
# may come after, on a loaded node): the run is closed as the limit's (closing_on_term, batch_script.py),
# not reported as the step's failure.
AT_THE_LIMIT = f"{{ {TIME_LIMIT_TEST} && closing_on_term; }}"
