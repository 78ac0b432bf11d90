"""The batch script's checkpoint steps: the job's $CHECKPOINT_DIR mirrored to the results container while
it runs, and `launch --resume-from RUN` fetched from there, on the cluster, before the command starts.

Pure functions from a JobSpec's parts to bash lines for job.sh's sections (dtrain/jobs/job_spec.py's
ScriptLines, which dtrain/jobs/batch_script.py puts in place).
The tools they run are the run's copies of dtrain/remote/job/checkpoint_mirror.py and
fetch_checkpoint.py, with the credential the results upload has (a SAS file in the run directory
locally, the nodes' managed identity on Azure): no other secret travels, and no checkpoint byte passes
through the operator's machine.
"""

from __future__ import annotations

import re

from dtrain.cluster.ssh import q
from dtrain.jobs.job_spec import ResultsTarget, ScriptLines

CHECKPOINTS = "checkpoints"  # RUN/checkpoints/ in the results container, as $CHECKPOINT_DIR is RUN_DIR/checkpoints
# Our jobs' checkpoints under it (training/checkpoint: ckpt-<step>.ckpt, a model-parallel step-<step>/), as
# dtrain/remote/job/fetch_checkpoint.py's OURS, which runs on the hosts and cannot import this
OUR_CHECKPOINT = re.compile(r"^(?:ckpt-(\d{10})\.ckpt|step-(\d{10})/[^/]+)$")
# In the run's remote/ directory, not the job's checkpoint directory (its code may list it): what the mirror
# sent (checkpoint_mirror.STATE, which upload_results.py reads too), and that the resume's fetch was done
# (a requeued attempt does not fetch the old run's checkpoint again)
MIRROR_STATE = '"$TOOLS/checkpoints-mirrored.json"'
RESUMED_MARKER = '"$TOOLS/resumed"'


def container_flags(results: ResultsTarget) -> str:
    """The job tools' flags for the results container and its credential (never the credential itself)."""
    flags = f"--account-url {q(results.account_url)} --container {q(results.container)}"
    if results.sas_file:
        return f'{flags} --sas-file "$RUN_DIR"/{q(results.sas_file)}'
    return f"{flags} --managed-identity" + (f" --client-id {q(results.client_id)}" if results.client_id else "")


def _mirror(run_id: str, results: ResultsTarget) -> str:
    prefix = q(f"{run_id}/{CHECKPOINTS}")
    where = f'--dir "$CHECKPOINT_DIR" --prefix {prefix} --state {MIRROR_STATE}'
    return f'"$PY" "$TOOLS/checkpoint_mirror.py" {where} {container_flags(results)}'


def script_lines(run_id: str, results: ResultsTarget, resume_from: str | None) -> ScriptLines:
    """Before the launch: fetch --resume-from's checkpoint (once per run), then start the mirror beside the
    job. In finish(): stop the mirror, before the results upload makes its last pass (upload_results.py
    --with-checkpoints; Slurm's TERM may have stopped it already)."""
    stop_mirror = '  [ -n "${MIRROR_PID:-}" ] && { kill "$MIRROR_PID" 2>/dev/null; wait "$MIRROR_PID"; }'
    return ScriptLines(before_launch=_before_launch(run_id, results, resume_from), on_finish=(stop_mirror,))


def _before_launch(run_id: str, results: ResultsTarget, resume_from: str | None) -> list[str]:
    lines = ['mkdir -p "$CHECKPOINT_DIR"']
    if resume_from:
        tool = f'"$PY" "$TOOLS/fetch_checkpoint.py" --run {q(resume_from)} --dest "$CHECKPOINT_DIR"'
        fetch = f"{tool} {container_flags(results)}"
        why = f"[job] the checkpoint of {resume_from} could not be fetched: training not started"
        failed = f"echo {q(why)}; exit 1"
        lines += [
            f"if [ ! -e {RESUMED_MARKER} ]; then",
            f"  {fetch} 2>&1 | sed 's/^/[job] /'",
            f'  [ "${{PIPESTATUS[0]}}" -eq 0 ] || {{ {failed}; }}',
            f"  touch {RESUMED_MARKER}",
            "fi",
        ]
    # in the background, with USR1 still ignored (a Spot agent or time warning signals only who catches it)
    return [*lines, f"{_mirror(run_id, results)} &", "MIRROR_PID=$!"]
