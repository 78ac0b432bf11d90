"""Follow a run: stream its log (already `[rank|host]`-annotated on the cluster) until Slurm says the job
has ended, then report its exit from the run's status.json and verdict.json.

Following is only reading: the job does not depend on it. Killing the follower (or closing the laptop)
leaves the job running, and its results are uploaded by the job itself.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from scripts.cluster import ClusterDescription
from scripts.errors import ExitCode
from scripts.processes import stop_process_group
from scripts.runs import Run, list_runs
from scripts.slurm import ACTIVE_STATES, Slurm
from scripts.sshutil import SSH, q
from scripts.ui import make_console

console = make_console()
POLL_S = 2.0
TAIL_SETTLE_S = 1.5  # tail -F looks at the file every second: time for the last lines to arrive
CANCEL_WAIT_S = 30.0


def _print(line: str) -> None:
    print(line, flush=True)


def stream_until_done(ssh: SSH, slurm: Slurm, run: Run, echo: Callable[[str], None] = _print) -> None:
    """Print the run's log from the start, and new lines as they come, until the job leaves the queue."""
    # --pid: the remote tail ends with its SSH session (else it would outlive us on the login node,
    # until the log next changed)
    log = q(f"{run.run_dir}/output.log")
    tail = ssh.popen(ssh.login, f'tail -n +1 -F --pid="$PPID" {log} 2>/dev/null', text=True, bufsize=1)
    reader = threading.Thread(target=_pump, args=(tail, echo), daemon=True)
    reader.start()
    try:
        _wait_for_end(slurm, str(run.job_id))
        time.sleep(TAIL_SETTLE_S)
    finally:
        stop_process_group(tail)
        reader.join(timeout=5)


def _pump(tail: object, echo: Callable[[str], None]) -> None:
    for line in tail.stdout:  # type: ignore[attr-defined]
        echo(line.rstrip("\n"))


def _wait_for_end(slurm: Slurm, job_id: str) -> None:
    said = ""
    while True:
        found = [job for job in slurm.queue(job_id) if job.job_id == job_id]
        if not found or found[0].state not in ACTIVE_STATES:
            return
        job = found[0]
        news = f"{job.state} {job.reason}" if job.state == "PENDING" else job.state  # squeue's "(Resources)"
        if news != said:
            console.print(f"[dim]job {job_id}: {news}[/dim]")
            said = news
        time.sleep(POLL_S)


def outcome(desc: ClusterDescription, slurm: Slurm, run: Run) -> int:
    """Print how the run ended and return its exit status (the job's own)."""
    final = list_runs(desc, slurm, run=run.run_id, limit=1) if run.run_id else []
    done = final[0] if final else run
    code = done.exit_code
    if code is None:
        console.print(
            f"[red]{done.label} ended without an exit status: cancelled before it started, or the node running "
            "its batch script failed[/red]"
        )
        return int(ExitCode.FAILED)
    verdict = done.verdict or {}
    if code != 0 and verdict.get("failed_rank") is not None:
        why = f"rank {verdict['failed_rank']} on {verdict.get('failed_host') or '?'} failed"
        if verdict.get("job_error"):
            why += f": {verdict['job_error']}"
        console.print(f"[red]{done.label}: {why}[/red]")
    results = (done.job or {}).get("results_url")
    if (done.status or {}).get("results") != "uploaded":
        console.print(f"[red]{done.label}: its results did not reach {results} (see the end of its log)[/red]")
        code = code or int(ExitCode.FAILED)
        results = None
    where = f"; results {results}" if results else ""
    console.print(f"{done.label}: {'ok' if code == 0 else f'exit {code}'}{where}")
    if done.cost_summary:
        console.print(f"{done.label}: {done.cost_summary}")
    return code


def follow(desc: ClusterDescription, ssh: SSH, slurm: Slurm, run: Run, echo: Callable[[str], None] = _print) -> int:
    stream_until_done(ssh, slurm, run, echo)
    return outcome(desc, slurm, run)


def ask_cancel_or_detach(slurm: Slurm, run: Run) -> int:
    """Ctrl-C while following: on a terminal, ask; without one, detach (the job goes on)."""
    answer = "d"
    if sys.stdin.isatty():
        try:
            answer = console.input(f"\n{run.label} is still running: [c]ancel it, or [d]etach? ").strip().lower()[:1]
        except (EOFError, KeyboardInterrupt):
            answer = "d"
    if answer == "c":
        cancel_and_wait(slurm, str(run.job_id))
        console.print(f"{run.label} cancelled")
    else:
        console.print(f"detached: {run.label} runs on; follow it with `python -m scripts logs {run.job_id} -f`")
    return int(ExitCode.INTERRUPTED)


def cancel_and_wait(slurm: Slurm, job_id: str, timeout: float = CANCEL_WAIT_S) -> bool:
    """scancel, then wait until Slurm has ended every step (KillWait); False if it is still there."""
    slurm.cancel(job_id)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if slurm.job_state(job_id) is None:
            return True
        time.sleep(0.5)
    return False
