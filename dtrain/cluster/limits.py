"""A person's Slurm limits and GPU-hour budget (and their account's), and Slurm's reasons for holding a job
over them, in words:
what `launch` and `jobs` say of a held job, and the warning `launch` gives when a budget is nearly spent.
Runs on the operator's machine and reads Slurm over the login node's SSH: sacctmgr for the association's
limits (the head's apply-users sets them from the users list, infra/users.py), sshare for this month's use.

Slurm (AccountingStorageEnforce=limits,safe, infra/cloud_init/slurm.py) holds a job over a limit in the
queue with a reason (squeue's %r): AssocGrpGRES while the person's running jobs hold their GPU cap
(GrpTRES gres/gpu), AssocGrpGRESMinutes while their GPU-hour budget (GrpTRESMins gres/gpu) has too little
left for the job's time limit x GPUs (`safe`: what running jobs may still use counts as spent),
AssocMaxJobsLimit at their cap of running jobs, AssocMaxNodePerJobLimit for a job larger than they may run.
An account's own GPU cap and budget (all its members' jobs together) hold a job with the same two reasons
as a person's: which of the two holds it is read from the figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dtrain.cluster.slurm import QueuedJob, Slurm, SlurmUnreachable
from dtrain.cluster.ssh import SSHFailure, q

GPU_TRES = "gres/gpu"
BUDGET_WARNING = 0.9  # a budget spent this much is warned about at launch
_BETWEEN = "--- sshare ---"  # between the two commands' outputs in one SSH call
LIMIT_REASONS = ("Assoc", "QOS")  # how Slurm's reasons for a job over a limit begin (AssocGrpGRES, QOSMaxJobs...)
# How long `launch --detach` waits for Slurm's first look at a job it submitted (the scheduler runs on each
# submission: a second, usually) to say whether it is held.
VERDICT_WAIT_S = 30.0
VERDICT_POLL_S = 0.5


@dataclass(frozen=True)
class AccountStanding:
    """An account's own association (all its members' jobs together): its GPU cap and GPU-hour budget (None:
    none) and their use of the budget, in GPU-minutes, as Standing's."""

    account: str
    max_gpus: int | None = None
    budget: int | None = None
    used: int = 0
    running: int = 0

    def budget_spent(self) -> bool:
        return self.budget is not None and self.used >= self.budget


@dataclass(frozen=True)
class Standing:
    """A person's association: its limits (None: none) and their use of the GPU-hour budget, in GPU-minutes."""

    user: str
    account: str
    max_jobs: int | None = None
    max_nodes: int | None = None
    max_gpus: int | None = None
    budget: int | None = None  # GPU-minutes a month (GrpTRESMins)
    used: int = 0  # this month's, as slurmctld last tallied it (every PriorityCalcPeriod)
    running: int = 0  # what the running jobs may still use (time left x GPUs): `safe` counts it as spent
    of_account: AccountStanding | None = None  # their account's own limits, where it has any

    def budget_spent(self) -> bool:
        return self.budget is not None and self.used >= self.budget


def gpu_hours(minutes: int) -> str:
    return f"{minutes / 60:,.2f}"


def read_standings(slurm: Slurm) -> dict[str, Standing]:
    """user -> their association (the first Slurm lists, for a user of several accounts); empty where Slurm's
    accounting does not answer: what is said of a held job is then Slurm's reason without the figures."""
    script = (
        "sacctmgr --noheader --parsable2 show association format=user,account,maxjobs,maxnodes,grptres,grptresmins"
        f" && echo {q(_BETWEEN)} && sshare --noheader --parsable2 --all --format=account,user,grptresraw,tresrunmins"
    )
    try:
        result = slurm.run_unchecked(script)
    except SSHFailure:
        return {}
    if result.returncode != 0 or _BETWEEN not in result.stdout:
        return {}
    limits, usage = result.stdout.split(_BETWEEN, 1)
    used = {}  # (user, account) -> (GPU-minutes used, held by running jobs); user "" for the account's own
    for line in usage.splitlines():
        fields = [field.strip() for field in line.split("|")]
        if len(fields) == 4:
            used[(fields[1], fields[0])] = (_gpus(fields[2]) or 0, _gpus(fields[3]) or 0)
    rows = [fields for fields in (line.split("|") for line in limits.splitlines()) if len(fields) == 6]
    accounts = {}
    for _, account, _, _, grp_tres, grp_tres_mins in (fields for fields in rows if not fields[0]):
        max_gpus, budget = _gpus(grp_tres), _gpus(grp_tres_mins)
        if max_gpus is not None or budget is not None:
            accounts[account] = AccountStanding(account, max_gpus, budget, *used.get(("", account), (0, 0)))
    standings: dict[str, Standing] = {}
    for user, account, max_jobs, max_nodes, grp_tres, grp_tres_mins in rows:
        if not user or user in standings:
            continue
        spent, running = used.get((user, account), (0, 0))
        standings[user] = Standing(
            user, account, _count(max_jobs), _count(max_nodes), _gpus(grp_tres), _gpus(grp_tres_mins), spent, running,
            accounts.get(account),
        )  # fmt: skip
    return standings


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _gpus(tres: str) -> int | None:
    """The GPUs' figure of a TRES list (`cpu=4,gres/gpu=8` -> 8); None where it names none."""
    for item in tres.split(","):
        name, _, value = item.partition("=")
        if name == GPU_TRES and value.isdigit():
            return int(value)
    return None


def held(reason: str, user: str, standing: Standing | None) -> str | None:
    """One line on a job Slurm holds over a limit (reason: squeue's), with what it means and what to do; None
    for a reason that is no limit (Priority, Resources, ...)."""
    reason = reason.strip().strip("()")
    meaning = _meaning(reason, user, standing or Standing(user, ""))
    return None if meaning is None else f"held ({reason}): {meaning}"


def _meaning(reason: str, user: str, s: Standing) -> str | None:
    if reason == "AssocGrpGRES":
        return _gpus_in_use(user, s)
    if reason == "AssocGrpGRESMinutes":
        return _over_budget(user, s)
    if reason == "AssocMaxJobsLimit":
        cap = _many(s.max_jobs, "job") if s.max_jobs is not None else "as many jobs as they may"
        return f"{user} runs {cap} at once already, their limit; it starts as one ends"
    if reason == "AssocMaxNodePerJobLimit":
        cap = _many(s.max_nodes, "node") if s.max_nodes is not None else "fewer nodes"
        return f"{user} may use {cap} in one job and this one asks for more: cancel it and ask for fewer --nodes"
    if reason.startswith(LIMIT_REASONS):
        return f"a limit of {user}'s Slurm association or QOS; `sacctmgr show association user={user}` lists them"
    return None


def _many(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def _gpus_in_use(user: str, s: Standing) -> str:
    """AssocGrpGRES: the person's GPU cap, or their account's, is held by running jobs."""
    account = s.of_account
    own = f"{user}'s GPU limit" + (f" ({_many(s.max_gpus, 'GPU')} at once)" if s.max_gpus is not None else "")
    if account is None or account.max_gpus is None:
        return f"{own} is in use by their running jobs; it starts as they end"
    shared = f"the account {account.account}'s GPU limit ({_many(account.max_gpus, 'GPU')} at once, all its members)"
    if s.max_gpus is None:
        return f"{shared} is in use by its members' running jobs; it starts as they end"
    return f"{own}, or {shared}, is in use by running jobs; it starts as they end"


def _over_budget(user: str, s: Standing) -> str:
    account = s.of_account
    binding = account is not None and account.budget is not None and not s.budget_spent()
    if binding and (s.budget is None or account.budget_spent() or _left(account) < _left(s)):
        return _account_over_budget(account)
    if s.budget is None:
        return f"{user}'s GPU-hour budget is spent, or has too little left for this job's time limit x GPUs"
    if s.budget_spent():
        spent = f"{gpu_hours(s.used)} of {gpu_hours(s.budget)} GPU-hours this month"
        return (
            f"{user}'s GPU-hour budget is spent ({spent}): an admin may raise it "
            f"(`dtrain users limit {user} --gpu-hours H`); it renews on the 1st"
        )
    left = f"{gpu_hours(s.used)} used, {gpu_hours(s.running)} held by running jobs, of {gpu_hours(s.budget)}"
    then = "it may start as their running jobs end, or " if s.running else ""
    return (
        f"{user}'s GPU-hour budget has too little left for this job's time limit x GPUs ({left} GPU-hours this "
        f"month): {then}cancel it and ask for a shorter --time or fewer GPUs"
    )


def _left(s: Standing | AccountStanding) -> int:
    """GPU-minutes of the budget that neither ended nor running jobs took (a budget is set)."""
    assert s.budget is not None
    return s.budget - s.used - s.running


def _account_over_budget(a: AccountStanding) -> str:
    budget = gpu_hours(a.budget or 0)
    if a.budget_spent():
        return (
            f"the account {a.account}'s GPU-hour budget is spent ({gpu_hours(a.used)} of {budget} GPU-hours this "
            f"month, all its members): an admin may raise it (`dtrain users limit-account {a.account} --gpu-hours H`); "
            "it renews on the 1st"
        )
    left = f"{gpu_hours(a.used)} used, {gpu_hours(a.running)} held by running jobs, of {budget}"
    then = "it may start as its members' running jobs end, or " if a.running else ""
    return (
        f"the account {a.account}'s GPU-hour budget has too little left for this job's time limit x GPUs ({left} "
        f"GPU-hours this month, all its members): {then}cancel it and ask for a shorter --time or fewer GPUs"
    )


def budget_warning(standing: Standing | None) -> str | None:
    """The warning `launch` gives where a person's budget, or their account's, is nearly spent (spent: the job
    is held, and says so)."""
    if standing is None:
        return None
    for whose, s in ((f"{standing.user}'s", standing), (f"the account {standing.account}'s", standing.of_account)):
        if s is None or not s.budget or s.budget_spent() or s.used / s.budget < BUDGET_WARNING:
            continue
        return (
            f"warning: {whose} GPU-hour budget is {s.used / s.budget:.0%} spent ({gpu_hours(s.used)} of "
            f"{gpu_hours(s.budget)} GPU-hours this month)"
        )
    return None


def explain_queue(slurm: Slurm, queue: list[QueuedJob]) -> dict[str, str]:
    """job id -> the held line of each pending job over a limit; the standings read only where there is one."""
    over = [job for job in queue if job.state == "PENDING" and held(job.reason, job.user, None) is not None]
    if not over:
        return {}
    standings = read_standings(slurm)
    return {job.job_id: held(job.reason, job.user, standings.get(job.user)) or job.reason for job in over}


def held_at_submission(slurm: Slurm, job_id: str) -> str | None:
    """The held line of a job just submitted, once Slurm's scheduler has looked at it (it runs, or waits with a
    reason); None where it is not held over a limit, or Slurm did not look within VERDICT_WAIT_S (the job is
    submitted either way: `jobs` shows the reason later)."""
    deadline = time.monotonic() + VERDICT_WAIT_S
    try:
        while True:
            found = [job for job in slurm.queue(job_id) if job.job_id == job_id]
            looked = not found or found[0].state != "PENDING" or found[0].reason.strip("()") not in ("", "None")
            if looked or time.monotonic() > deadline:
                return explain_queue(slurm, found).get(job_id) if looked else None
            time.sleep(VERDICT_POLL_S)
    except (SlurmUnreachable, SSHFailure):
        return None
