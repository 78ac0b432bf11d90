"""Follow a run: stream its log (already `[rank|host]`-annotated on the cluster) until Slurm says the job
has ended, then report its exit from the run's status.json and verdict.json.

Following is only reading: the job does not depend on it. Killing the follower (or closing the laptop)
leaves the job running, and its results are uploaded by the job itself. An outage of SSH to the login
host or of slurmctld is waited out (dtrain/cluster/slurm.py's `patiently`): a question Slurm did not answer is
never taken for "the job has ended".
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.limits import explain_queue
from dtrain.cluster.node_reports import boot_verdict, read_reports
from dtrain.cluster.slurm import ACTIVE_STATES, NodeInfo, QueuedJob, Slurm, patiently
from dtrain.cluster.ssh import SSH, q
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.launcher_noise import without_launcher_tracebacks
from dtrain.jobs.runs import Run, list_runs, without_status
from dtrain.jobs.task_steps import secrets_dir
from dtrain.processes import stop_process_group
from dtrain.ui import make_console

console = make_console()
POLL_S = 2.0
TAIL_SETTLE_S = 1.5  # tail -F looks at the file every second: time for the last lines to arrive
CANCEL_WAIT_S = 30.0
# A COMPLETING job that cannot be requeued has ended (cancelled, failed or done); Slurm is only
# waiting for its nodes to finish the epilog. A node that is not responding, or still powering up for
# a job cancelled before it started, can hold the job there for many minutes (SlurmdTimeout,
# ResumeTimeout): follow reports the end after this long instead of waiting that out. (squeue shows a
# job being requeued as COMPLETING too: a --requeue/--spot job is followed until Slurm lets it go.)
COMPLETING_WAIT_S = 30.0


def _print(line: str) -> None:
    print(line, flush=True)


def stream_until_done(
    ssh: SSH, slurm: Slurm, run: Run, echo: Callable[[str], None] = _print, desc: ClusterDescription | None = None
) -> None:
    """Print the run's log from the start, and new lines as they come, until the job leaves the queue.
    An outage of SSH or of slurmctld is waited out (up to OUTAGE_PATIENCE_S at a time): the log is
    read again from the first line not yet printed, and the queue asked again. With desc, while the job's
    nodes start (CONFIGURING), the boot step each of them is in."""
    tail = LogTail(ssh, f"{run.run_dir}/output.log", echo)
    try:
        may_requeue = bool((run.job or {}).get("requeue", True))
        _wait_for_end(slurm, str(run.job_id), tail, desc, may_requeue=may_requeue)
        time.sleep(TAIL_SETTLE_S)
    finally:
        tail.stop()


class LogTail:
    """`tail -F` of a file on the login node over SSH, started again where it left off if SSH drops."""

    def __init__(self, ssh: SSH, path: str, echo: Callable[[str], None]):
        self.ssh, self.path, self.echo = ssh, path, echo
        self.printed = 0  # lines of the file echoed so far
        self.tail: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        # --pid: the remote tail ends with its SSH session (else it would outlive us on the login node,
        # until the log next changed)
        command = f'tail -n +{self.printed + 1} -F --pid="$PPID" {q(self.path)} 2>/dev/null'
        self.tail = self.ssh.popen(self.ssh.login, command, text=True, bufsize=1)
        self.reader = threading.Thread(target=self._pump, args=(self.tail,), daemon=True)
        self.reader.start()

    def _pump(self, tail: subprocess.Popen) -> None:
        for line in tail.stdout:  # type: ignore[union-attr]
            self.echo(line.rstrip("\n"))
            self.printed += 1

    def keep_alive(self) -> None:
        """Start the tail again if its SSH connection ended (the reader has printed all it got)."""
        if self.tail is not None and self.tail.poll() is not None and self.reader is not None:
            self.reader.join(timeout=5)
            self.start()

    def stop(self) -> None:
        if self.tail is not None:
            stop_process_group(self.tail)
        if self.reader is not None:
            self.reader.join(timeout=5)


def _wait_for_end(
    slurm: Slurm, job_id: str, tail: LogTail, desc: ClusterDescription | None = None, *, may_requeue: bool
) -> None:
    said, completing_since = "", None
    while True:
        found = [job for job in patiently(lambda: slurm.queue(job_id), f"about job {job_id}") if job.job_id == job_id]
        if not found or found[0].state not in ACTIVE_STATES:
            return
        job = found[0]
        if job.state == "COMPLETING" and not may_requeue:
            completing_since = completing_since or time.monotonic()
            if time.monotonic() - completing_since >= COMPLETING_WAIT_S:
                console.print(
                    f"job {job_id} has ended; Slurm is still cleaning up on {job.reason or 'its nodes'}",
                    style="dim",
                    markup=False,
                )
                return
        news = queue_news(job)
        if job.state == "CONFIGURING" and desc is not None:  # its nodes are starting: where each is
            news += patiently(lambda: nodes_booting(desc, slurm, job_id), f"about job {job_id}'s nodes")
        if news != said:  # a job held over a limit: why, in words (dtrain/cluster/limits.py)
            shown = explain_queue(slurm, [job]).get(job_id, news)
            console.print(f"job {job_id}: {shown}", style="dim", markup=False, soft_wrap=True)
            said = news
        tail.keep_alive()
        time.sleep(POLL_S)


def nodes_booting(desc: ClusterDescription, slurm: Slurm, job_id: str) -> str:
    """': node-1 step 3 of 7, slurmd (running since ...); ...' for the job's nodes that are booting, from
    their boot reports; empty where none has reported yet."""
    boot = read_reports(desc, slurm)["boot"]
    nodes = [node for node in slurm.job_nodes(job_id) if node in boot and boot[node].get("ok") != "1"]
    return "".join(f"; {node} {boot_verdict(boot[node], markup=False)}" for node in nodes)


def queue_news(job: QueuedJob) -> str:
    """The job's state, with why it waits while pending (squeue's "(Resources)"); none when Slurm gives
    none (`(None)`: it has not looked at the job yet)."""
    reason = job.reason.strip().strip("()")
    return f"{job.state} ({reason})" if job.state == "PENDING" and reason not in ("", "None", "null") else job.state


def outcome(desc: ClusterDescription, slurm: Slurm, run: Run) -> int:
    """Print how the run ended and return its exit status (the job's own)."""
    final = patiently(lambda: list_runs(desc, slurm, run=run.run_id, limit=1), "about the run") if run.run_id else []
    done = final[0] if final else run
    code = done.exit_code
    if code is None:
        ended = patiently(lambda: slurm.ended_jobs([done.job_id] if done.job_id else []), "about the job")
        _, why = without_status(ended.get(done.job_id or ""))
        console.print(f"{done.label} ended without an exit status: {why}", style="red", markup=False, soft_wrap=True)
        return int(ExitCode.FAILED)
    verdict = done.verdict or {}
    if done.ended_by_time_limit:
        limit = (done.job or {}).get("time_limit") or "?"
        console.print(f"{done.label}: its time limit ({limit}) ended it; ask for more with --time", style="red")
    elif done.cancelled:  # the ranks' own errors then are the cancel's echo, not a cause
        console.print(f"{done.label}: cancelled", style="red", markup=False)
    elif code != 0 and (verdict.get("failed_rank") is not None or verdict.get("job_error")):
        why = (
            "failed"
            if verdict.get("failed_rank") is None
            else f"rank {verdict['failed_rank']} on {verdict.get('failed_host') or '?'} failed"
        )
        if verdict.get("job_error"):
            why += f": {verdict['job_error']}"
        console.print(f"{done.label}: {why}", style="red", markup=False)
    results = (done.job or {}).get("results_url")
    if (done.status or {}).get("results") != "uploaded":
        missing = (done.status or {}).get("not_uploaded")
        what = f"{', '.join(missing)} of its results" if missing else "its results"
        console.print(
            f"{done.label}: {what} did not reach {results} (see the end of its log)", style="red", markup=False
        )
        code = code or int(ExitCode.FAILED)
        results = None
    where = f"; results {results}" if results else ""
    console.print(f"{done.label}: {'ok' if code == 0 else f'exit {code}'}{where}", markup=False)
    if done.cost_summary:
        console.print(f"{done.label}: {done.cost_summary}")
    return code


def follow(
    desc: ClusterDescription,
    ssh: SSH,
    slurm: Slurm,
    run: Run,
    echo: Callable[[str], None] = _print,
    *,
    debug: bool = False,
) -> int:
    """The run's log until the job ends, then how it ended (`launch --follow`, `logs -f`): a launcher's
    own traceback is left out of the stream unless debug (the log keeps it)."""
    stream_until_done(ssh, slurm, run, echo if debug else without_launcher_tracebacks(echo), desc)
    return outcome(desc, slurm, run)


def ask_cancel_or_detach(slurm: Slurm, run: Run) -> int:
    """Ctrl-C while following: on a terminal, ask; without one, detach (the job goes on)."""
    answer = "d"
    if sys.stdin.isatty():
        try:
            # markup=False: rich would read [c] and [d] as style tags and show no choices at all
            prompt = f"\n{run.label} is still running: [c]ancel it, or [d]etach? "
            answer = console.input(prompt, markup=False).strip().lower()[:1]
        except (EOFError, KeyboardInterrupt):
            answer = "d"
    if answer == "c":
        if cancel_and_wait(slurm, str(run.job_id), run_dir=run.run_dir):
            console.print(f"{run.label} cancelled: no process of it is left on any node")
        else:
            console.print(f"{run.label} cancelled, but Slurm still holds it after {CANCEL_WAIT_S:.0f} s", style="red")
    else:
        console.print(f"detached: {run.label} runs on; follow it with `dtrain logs {run.job_id} -f`")
    return int(ExitCode.INTERRUPTED)


def cancel_and_wait(slurm: Slurm, job_id: str, run_dir: str | None = None, timeout: float = CANCEL_WAIT_S) -> bool:
    """scancel, then wait until Slurm has ended every step (KillWait) and run the epilog on each of the
    job's nodes (it kills what Slurm lost track of): False if Slurm still holds the job. Raises if the
    epilog of a node failed (Slurm drained it: something of the job may be left there). The run's
    secrets go with it: a job cancelled before it started never ran the script that removes them."""
    nodes = patiently(lambda: slurm.job_nodes(job_id), f"about job {job_id}")
    patiently(lambda: slurm.cancel(job_id), f"to cancel job {job_id}")
    deadline = time.time() + timeout
    while patiently(lambda: slurm.job_state(job_id), f"about job {job_id}") is not None:
        if time.time() > deadline:
            return False
        time.sleep(0.5)
    if run_dir:
        slurm.run_unchecked(f"rm -rf {q(secrets_dir(run_dir))}")
    failed = [n for n in patiently(slurm.nodes, "about the nodes") if n.name in nodes and _epilog_failed(n)]
    if failed:
        names = ", ".join(node.name for node in failed)
        raise OperatorError(
            f"job {job_id} was cancelled, but the epilog of {names} failed and Slurm drained it: a process of "
            "the job may be left there (see the node's slurmd log; `scontrol update nodename=... state=resume` "
            "once it is clear)",
            ExitCode.FAILED,
        )
    return True


def _epilog_failed(node: NodeInfo) -> bool:
    return "epilog" in node.reason.lower() and any(word in node.state for word in ("drain", "down", "fail"))
