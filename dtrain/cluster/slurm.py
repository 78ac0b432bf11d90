"""Slurm's commands on the cluster's login node, over SSH: sbatch, squeue, scancel, sinfo, and the admin's
scontrol (drain, resume, requeue).

Slurm is the scheduler; this module only speaks its command-line protocol (`--parsable`, fixed
`--format` strings) and turns its failures into operator errors. It keeps no state of its own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dtrain.cluster.description import ClusterDescription, SlurmAccess
from dtrain.cluster.ssh import SSH, SSHFailure, as_root, q
from dtrain.errors import ExitCode, OperatorError
from dtrain.ui import make_console

T = TypeVar("T")
console = make_console()

JOB_ID = re.compile(r"\d+")
# squeue's states for a job that has not ended; anything else (or no line) means it has.
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
     "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
)  # fmt: skip
# How dtrain/remote/slurm/slurm_power.py's reaper begins the reason of a node it deallocated for not
# registering (`not registered 35 min after its start: deallocated (<Azure's view>)`).
UNREGISTERED_REASON = "not registered "
_SEP = "\x1f"  # between squeue/sinfo fields: never in a job name, a reason or a node name
_SCONTROL_FIELD = re.compile(r"(?:^|\s)(\w+)=(\S*)")  # `scontrol --oneliner show job`: Key=value ...
# What squeue and scancel say of a job id slurmctld no longer holds: an answer, not a failure.
_UNKNOWN_JOB = "Invalid job id specified"
# What Slurm says to a user who acts on another user's job (scancel): a refusal, not an outage.
_REFUSED = "Access/permission denied"
# How long an operator command keeps asking through an outage (SSH to the login node, or slurmctld
# restarting) before it gives up with exit 3: one restart of either takes seconds to a minute.
OUTAGE_PATIENCE_S = 120.0
RETRY_INTERVAL_S = 2.0


class SlurmRefused(OperatorError):
    """Slurm answered no: the job is another user's. Its words are the message."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.NOT_READY)


class SlurmUnreachable(OperatorError):
    """Slurm could not be asked (SSH to the login node failed, slurmctld did not answer): no answer,
    so nothing may be concluded about the job from it."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.NOT_READY)


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    name: str  # the run id
    state: str
    user: str
    nodes: str  # the allocated node list, or the node count while pending
    elapsed: str
    reason: str  # why it waits (Resources, Priority, ...) or the node list while it runs


@dataclass(frozen=True)
class EndedJob:
    """Slurm's own record of a job that has ended: what tells why one ended without writing its status."""

    state: str  # FAILED, CANCELLED, NODE_FAIL, BOOT_FAIL, OUT_OF_MEMORY, ...
    reason: str  # JobLaunchFailure, NodeDown, None, ...
    exit_status: int  # the batch script's (ExitCode=STATUS:SIGNAL)
    signal: int  # the signal that ended it; 0 for none
    started: bool  # whether its batch script was started (a pending job cancelled has a StartTime too)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # sinfo's long state: idle, allocated, drained, down, ... with '~' when powered down
    reason: str
    cpus: str
    gres: str

    @property
    def base_state(self) -> str:
        """The state without sinfo's flag suffixes (~ powered down, * not responding, # powering up...)."""
        return self.state.rstrip("~*#!%$@^-")

    @property
    def powered_down(self) -> bool:
        return self.state.endswith("~") or "POWERED_DOWN" in self.state.upper()

    @property
    def not_responding(self) -> bool:
        """Its slurmd does not answer: off or gone for all Slurm knows (the head node's reaper asks Azure)."""
        return "*" in self.state

    @property
    def unregistered(self) -> bool:
        """Deallocated by the head node's reaper: Azure ran it, and it never registered with Slurm."""
        return self.powered_down and self.reason.startswith(UNREGISTERED_REASON)


# sinfo's options for NodeInfo's fields, one line per node and partition (parse_nodes reads them)
NODE_FIELDS = f"--noheader --Node --format={q(_SEP.join(('%N', '%T', '%E', '%c', '%G')))}"


def parse_nodes(text: str) -> list[NodeInfo]:
    """What `sinfo NODE_FIELDS` printed, one NodeInfo per node (a node of two partitions is listed twice)."""
    seen: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if line.count(_SEP) == 4:
            node = NodeInfo(*(part.strip() for part in line.split(_SEP)))
            seen.setdefault(node.name, node)
    return list(seen.values())


def require_slurm(desc: ClusterDescription) -> SlurmAccess:
    if desc.slurm is None:
        raise OperatorError(
            f"cluster {desc.name} has no Slurm (a local cluster in localhost mode): jobs need the namespace mode, "
            "`dtrain local up` as root",
            ExitCode.NOT_READY,
        )
    return desc.slurm


class Slurm:
    """Slurm's commands, run on the login node through `ssh`."""

    def __init__(self, desc: ClusterDescription, ssh: SSH):
        self.access = require_slurm(desc)
        self.ssh = ssh

    def script(self, script: str) -> str:
        """script as the login node must run it: with this cluster's SLURM_CONF."""
        conf = f"export SLURM_CONF={q(self.access.conf)}; " if self.access.conf else ""
        return conf + script

    def run_unchecked(self, script: str, *, timeout: float = 60, input: bytes | None = None) -> Result:
        """A shell script on the login node, with this cluster's SLURM_CONF; its status is the caller's."""
        proc = self.ssh.run(self.ssh.login, self.script(script), timeout=timeout, check=False, input=input)
        return Result(proc.returncode, _text(proc.stdout), _text(proc.stderr))

    def _ask(self, command: str, *, timeout: float = 60) -> Result:
        """A Slurm command whose failure to reach Slurm (SSH, or slurmctld) raises SlurmUnreachable;
        any other status, the command's own answer, is the caller's."""
        try:
            result = self.run_unchecked(command, timeout=timeout)
        except SSHFailure as exc:
            raise SlurmUnreachable(str(exc)) from None
        if result.returncode != 0 and _REFUSED in result.stderr:
            raise SlurmRefused(result.stderr.strip().splitlines()[-1])
        if result.returncode != 0 and _UNKNOWN_JOB not in result.stderr:
            word = command.split()[0]
            raise SlurmUnreachable(f"{word} on the login node failed: {result.stderr.strip()[-600:] or 'no message'}")
        return result

    def run(self, command: str, *, timeout: float = 60) -> str:
        result = self.run_unchecked(command, timeout=timeout)
        if result.returncode != 0:
            word = command.split()[0]
            raise OperatorError(f"{word} on the login node failed: {result.stderr.strip()[-600:]}", ExitCode.FAILED)
        return result.stdout

    @property
    def partitions(self) -> str:
        """The cluster's partitions as Slurm's commands take them: on demand, and Spot where there is one."""
        return ",".join(p for p in (self.access.partition, self.access.spot_partition) if p)

    def queue(self, job_id: str | None = None) -> list[QueuedJob]:
        """Every job Slurm still holds (pending, running, completing), or just job_id's."""
        fields = _SEP.join(("%i", "%j", "%T", "%u", "%D", "%M", "%R"))
        which = f"--jobs={q(job_id)}" if job_id else f"--partition={q(self.partitions)}"
        # squeue exits 1 for a job id it has already forgotten (an answer: no such job), and for a
        # slurmctld it cannot reach (no answer: SlurmUnreachable)
        text = self._ask(f"squeue --noheader {which} --format={q(fields)}").stdout
        return [QueuedJob(*line.split(_SEP)) for line in text.splitlines() if line.count(_SEP) == 6]

    def job_state(self, job_id: str) -> str | None:
        """The job's state while Slurm holds it; None once it has ended and left the queue."""
        found = [job for job in self.queue(job_id) if job.job_id == job_id]
        return found[0].state if found and found[0].state in ACTIVE_STATES else None

    def ended_jobs(self, job_ids: list[str]) -> dict[str, EndedJob]:
        """job id -> Slurm's record of its end, for those of job_ids that slurmctld still holds (for
        MinJobAge after their end); a job it has forgotten is left out. One SSH call for all of them."""
        if not job_ids:
            return {}
        show = "; ".join(f"scontrol --oneliner show job {q(job_id)} 2>/dev/null" for job_id in job_ids)
        text = self._ask(f"{show}; true").stdout
        ended = {}
        for line in text.splitlines():
            fields = dict(_SCONTROL_FIELD.findall(line))
            if fields.get("JobState", "") in ACTIVE_STATES or ":" not in fields.get("ExitCode", ""):
                continue
            status, signal = fields["ExitCode"].split(":", 1)
            ended[fields.get("JobId", "")] = EndedJob(
                state=fields["JobState"],
                reason=fields.get("Reason", "None"),
                exit_status=int(status),
                signal=int(signal),
                started=fields.get("BatchHost", "") not in ("", "(null)"),
            )
        return ended

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes allocated to a job Slurm holds, in order (its first runs the batch script); none while
        it is pending, or once it has ended."""
        text = self._ask(f"squeue --noheader --jobs={q(job_id)} --format=%N").stdout.strip()
        if not text:
            return []
        return self._ask(f"scontrol show hostnames {q(text)}").stdout.split()

    def cancel(self, job_id: str) -> None:
        """scancel; a job Slurm has already forgotten is cancelled as far as it goes. Another user's job:
        SlurmRefused."""
        self._ask(f"scancel {q(job_id)}")

    def node_addresses(self) -> dict[str, str]:
        """node -> the address Slurm reaches it at (NodeAddr: where its slurmd registered from)."""
        text = self.run(f"sinfo --noheader --Node --partition={q(self.partitions)} --format=%N{_SEP}%o")
        return dict(line.split(_SEP, 1) for line in text.splitlines() if line.count(_SEP) == 1)

    def nodes(self) -> list[NodeInfo]:
        return parse_nodes(self._ask(f"sinfo {NODE_FIELDS} --partition={q(self.partitions)}").stdout)

    # --- the admin's: scontrol as root (the admin user's sudo on Azure) --------------------------
    def _admin(self, command: str, what: str) -> Result:
        """A Slurm command that needs the cluster admin's rights; ``what`` says what it does, for a refusal."""
        try:
            result = self.run_unchecked(as_root(command))
        except SSHFailure as exc:
            raise SlurmUnreachable(str(exc)) from None
        text = result.stderr.strip()
        if result.returncode != 0 and ("sudo" in text or _REFUSED in text):
            raise SlurmRefused(f"only the cluster's admin may {what}: {text.splitlines()[-1]}")
        if result.returncode != 0:
            word = command.split()[0]
            raise SlurmUnreachable(f"{word} on the login node failed: {text[-600:] or 'no message'}")
        return result

    def drain(self, node: str, reason: str) -> None:
        """No new job starts on node; those running there go on (requeue() moves them)."""
        self._admin(f"scontrol update NodeName={q(node)} State=DRAIN Reason={q(reason)}", f"drain {node}")

    def resume_node(self, node: str) -> None:
        """Undo drain(): node takes jobs again."""
        self._admin(f"scontrol update NodeName={q(node)} State=RESUME", f"resume {node}")

    def running_on(self, node: str) -> list[str]:
        """The ids of the jobs running (or starting) on node."""
        text = self._ask(f"squeue --noheader --nodelist={q(node)} --states=RUNNING,CONFIGURING --format=%i").stdout
        return text.split()

    def requeue(self, job_id: str) -> str | None:
        """Requeue a running job: Slurm ends it and queues it again (with its id), to start once its nodes'
        epilog is done. None, or Slurm's reason for refusing it (a job submitted with --no-requeue)."""
        result = self.run_unchecked(as_root(f"scontrol requeue {q(job_id)}"))
        if result.returncode == 0:
            return None
        return (result.stderr.strip() or result.stdout.strip() or "no message").splitlines()[-1]

    def start_now(self, job_id: str) -> None:
        """Lift the two minutes Slurm holds a requeued job back (BeginTime): its epilog has run."""
        self._admin(f"scontrol update JobId={q(job_id)} StartTime=now", f"start job {job_id}")


def patiently(ask: Callable[[], T], what: str, patience_s: float = OUTAGE_PATIENCE_S) -> T:
    """ask(), asked again through an outage of Slurm or of SSH to it, for up to patience_s; said once
    on the console when it begins. Then SlurmUnreachable (exit 3): an unanswered question is never
    taken for an answer."""
    deadline = time.monotonic() + patience_s
    said = False
    while True:
        try:
            return ask()
        except (SlurmUnreachable, SSHFailure) as exc:  # SSHFailure: the run directories' readers
            if time.monotonic() + RETRY_INTERVAL_S > deadline:
                raise SlurmUnreachable(f"could not ask Slurm {what} for {patience_s:.0f} s: {exc}") from None
            if not said:
                console.print(
                    f"could not ask Slurm {what} ({exc}); asking again for {patience_s:.0f} s",
                    style="dim",
                    markup=False,
                )
                said = True
            time.sleep(RETRY_INTERVAL_S)


def parse_job_id(sbatch_output: str) -> str:
    """`sbatch --parsable` prints `<id>` or `<id>;<cluster>`."""
    first = sbatch_output.strip().splitlines()[-1] if sbatch_output.strip() else ""
    job_id = first.split(";", 1)[0]
    if not JOB_ID.fullmatch(job_id):
        raise OperatorError(f"sbatch gave no job id: {sbatch_output.strip()[-300:]!r}", ExitCode.FAILED)
    return job_id
