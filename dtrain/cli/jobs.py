"""The run lifecycle after `launch`: `jobs`, `logs JOB [-f]`, `cancel JOB...`, `status`.

JOB is a Slurm job id (digits) or a run id. Live state comes from Slurm (squeue, sinfo), with why a job
over a person's limit is held (dtrain/cluster/limits.py); what slurmctld has forgotten (MinJobAge after a
job's end) comes from the run directories on the shared file system, and the node table from each node's
last health check report (`<shared>/.health/<node>`) and boot report (`<shared>/.boot/<node>`, written
by node-setup, even when slurmd could not start).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

from rich.table import Table

from dtrain.cli_entry import add_cluster_option, arg_type, debugging, int_between
from dtrain.cluster.description import ClusterDescription, load
from dtrain.cluster.limits import explain_queue
from dtrain.cluster.node_reports import HEALTH_CHECKS, boot_verdict, read_reports
from dtrain.cluster.slurm import EndedJob, NodeInfo, QueuedJob, Slurm, SlurmRefused, patiently
from dtrain.cluster.ssh import SSH, q
from dtrain.cluster.telemetry import TelemetryUnavailable, alert_queries, gpu_alerts, idle_jobs, run_sections
from dtrain.errors import ExitCode, OperatorError
from dtrain.idle_cost import for_cluster
from dtrain.jobs.follow import cancel_and_wait, follow
from dtrain.jobs.runs import Run, check_job_reference, list_runs, resolve, without_status
from dtrain.jobs.slow_ranks import by_node, describe, running_run_ids, running_slow_ranks
from dtrain.json_documents import JobRow, JobsDocument, NodeRow, SlowRankRow, StatusDocument
from dtrain.ui import make_console

ELAPSED = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")  # squeue's %M
T = TypeVar("T")
IDLE_NOTE = "[red]GPUs idle[/red]"  # every GPU of the job, through the whole idle window
console = make_console()
out = make_console(stderr=False)


def configure(commands: argparse._SubParsersAction) -> None:
    jobs = commands.add_parser(
        "jobs",
        help="the queue and recent runs",
        description="Jobs Slurm holds (pending, running) and the most recent runs with their exit status: "
        "your own (the description's user), or everyone's with --all (another user's ended run by its name "
        "alone: its directory is theirs).",
        epilog="examples: python -m dtrain jobs --limit 50; python -m dtrain jobs --all.",
    )
    jobs.add_argument("--limit", type=int_between(1, 1000), default=20, help="recent runs to show (%(default)s)")
    jobs.add_argument("--all", action="store_true", help="every user's jobs and runs (default: your own)")
    jobs.add_argument(
        "--idle-window",
        type=int_between(10, 86400),
        metavar="SECONDS",
        help="mark a running job whose GPUs have all been idle this long (default: the cluster description's "
        "telemetry.idle_gpu_window_s, 600)",
    )
    logs = commands.add_parser(
        "logs",
        help="a job's output, every rank's line prefixed [rank|host]",
        description="Print a job's log from the shared file system; -f follows it until the job ends and "
        "exits with the job's status.",
        epilog="examples: python -m dtrain logs 42 -f; python -m dtrain logs 20261122T101500Z-pytorch-1a2b.",
    )
    logs.add_argument("job", type=arg_type(check_job_reference), metavar="JOB", help="Slurm job id or run id")
    logs.add_argument("-f", "--follow", action="store_true", help="stream new lines until the job ends")
    cancel = commands.add_parser(
        "cancel",
        help="stop a job on every node (scancel)",
        description="Cancel pending or running jobs and wait until Slurm has stopped all their processes "
        "(up to 30 s each). Every JOB is looked up before any is cancelled. A job still uploads its logs to "
        "the results container as it ends.",
        epilog="examples: python -m dtrain cancel 42; python -m dtrain cancel 42 43 20261122T101500Z-pytorch-1a2b.",
    )
    cancel.add_argument(
        "job", type=arg_type(check_job_reference), nargs="+", metavar="JOB", help="Slurm job ids or run ids"
    )
    status = commands.add_parser(
        "status",
        help="nodes (state, drain reason, power saving, boot, health checks) and the queue",
        description="The cluster at a glance: each node's Slurm state and drain reason, whether it is "
        "powered down (power saving), the setup steps that failed at its last boot (with why), its last "
        "health check, the slow ranks of running jobs on it, and the queue.",
        epilog="example: python -m dtrain status. Exit status 0, or 3 when no node can take a job.",
    )
    for parser, handler in ((jobs, run_jobs), (logs, run_logs), (cancel, run_cancel), (status, run_status)):
        add_cluster_option(parser)
        parser.set_defaults(handler=handler)
    for parser in (jobs, status):
        parser.add_argument(
            "--json",
            action="store_true",
            help="print one JSON document on stdout instead of the tables (an error document on failure)",
        )


def _connect(args: argparse.Namespace) -> tuple[ClusterDescription, SSH, Slurm]:
    desc = load(args.cluster)
    ssh = SSH(desc)
    return desc, ssh, Slurm(desc, ssh)


# --- jobs ----------------------------------------------------------------------------------------
def run_jobs(args: argparse.Namespace) -> int:
    desc, ssh, slurm = _connect(args)
    with ssh:
        queue = slurm.queue()
        # the running jobs' runs too, however old: their slow ranks (slow_ranks.json) are read with them
        runs = list_runs(desc, slurm, limit=args.limit, also=running_run_ids(queue))
        ended = slurm.ended_jobs(_without_status(queue, runs))
        window_s = args.idle_window or (desc.telemetry.idle_gpu_window_s if desc.telemetry else 0)
        idle = idle_gpu_jobs(desc, slurm, queue, window_s)
        held = explain_queue(slurm, queue)
    slow = running_slow_ranks(queue, runs)
    rows = [
        row.model_copy(update={"gpus_idle": idle.get(row.job or ""), "slow_ranks": slow.get(row.job or "", [])})
        for row in job_rows(queue, runs, ended, held)
    ]
    if not args.all:
        rows = [row for row in rows if row.user == desc.ssh_user]
    if args.json:
        JobsDocument(jobs=rows).print()
    else:
        out.print(jobs_table(rows))
    return 0


def idle_gpu_jobs(desc: ClusterDescription, slurm: Slurm, queue: Sequence[QueuedJob], window_s: int) -> dict[str, bool]:
    """job id -> whether its GPUs were all idle over the last window_s (Prometheus), for the running jobs that
    hold GPUs and have run that long; a warning and nothing when Prometheus does not answer."""
    running = [job.job_id for job in queue if job.state == "RUNNING" and (slurm_seconds(job.elapsed) or 0) >= window_s]
    if desc.telemetry is None or not running:
        return {}
    return _from_prometheus(lambda: idle_jobs(desc, slurm, running, window_s), "no job is marked idle")


def node_gpu_alerts(desc: ClusterDescription, slurm: Slurm) -> dict[str, list[str]]:
    """node -> its GPUs' XID errors and throttling, as Prometheus has them now."""
    if desc.telemetry is None:
        return {}
    return _from_prometheus(lambda: gpu_alerts(run_sections(slurm, alert_queries(desc))), "no GPU alert is shown")


def _from_prometheus(ask: Callable[[], dict[str, T]], without: str) -> dict[str, T]:
    """What ask() gets from Prometheus; a warning and nothing when Prometheus does not answer (the rest of
    the command's answer is still true)."""
    try:
        return ask()
    except TelemetryUnavailable as exc:
        console.print(f"[yellow]warning: no telemetry ({exc}): {without}[/yellow]")
        return {}


def _without_status(queue: Sequence[QueuedJob], runs: Sequence[Run]) -> list[str]:
    """The job ids of the runs that ended without writing their status: Slurm may still say why."""
    live = {job.job_id for job in queue}
    return [run.job_id for run in runs if run.job_id and run.status is None and run.job_id not in live]


def job_rows(
    queue: Sequence[QueuedJob], runs: Sequence[Run], ended: dict[str, EndedJob], held: dict[str, str] | None = None
) -> list[JobRow]:
    """One row per job: those Slurm holds, then the ended runs (newest first); what `jobs` shows. ended:
    Slurm's record of the jobs that ended without their status; held: job id -> why Slurm holds it over a limit."""
    live = {job.job_id for job in queue}
    queued_runs = {job.name for job in queue}
    rows = [ended_row(run, ended.get(run.job_id or "")) for run in runs if run.readable and run.job_id not in live]
    # another user's runs: the name and owner are all their directory shows (the queue has those it holds)
    rows += [unreadable_row(run) for run in runs if not run.readable and run.run_id not in queued_runs]
    return [queued_row(job, (held or {}).get(job.job_id)) for job in queue] + rows


def unreadable_row(run: Run) -> JobRow:
    return JobRow(
        job=None, run=run.run_id, state="UNREADABLE", in_queue=False, user=run.owner, nodes=None,
        elapsed_seconds=None, finished_at=None, exit_code=None, node_hours=None, billed_node_hours=None,
        estimated_cost_usd=None, note=f"{run.owner}'s: its run directory is theirs alone",
    )  # fmt: skip


def queued_row(job: QueuedJob, held: str | None = None) -> JobRow:
    """A job Slurm holds; held: why it waits, where that is a limit (dtrain/cluster/limits.py), else Slurm's reason."""
    return JobRow(
        job=job.job_id,
        run=job.name,
        state=job.state,
        in_queue=True,
        user=job.user,
        nodes=int(job.nodes) if job.nodes.isdigit() else None,
        elapsed_seconds=slurm_seconds(job.elapsed),
        finished_at=None,
        exit_code=None,
        node_hours=None,
        billed_node_hours=None,
        estimated_cost_usd=None,
        note=held or job.reason,
    )


def ended_row(run: Run, ended: EndedJob | None) -> JobRow:
    state, note = _ended_state(run) if run.status is not None else without_status(ended)
    record, job = run.record or {}, run.job or {}
    attempts = record.get("attempts") or [{}]
    return JobRow(
        job=run.job_id,
        run=run.run_id,
        state=state,
        in_queue=False,
        user=run.owner or job.get("submitted_by"),
        nodes=job.get("nodes"),
        elapsed_seconds=attempts[-1].get("seconds"),
        finished_at=(run.status or {}).get("finished_at"),
        exit_code=run.exit_code,
        node_hours=record.get("node_hours"),
        billed_node_hours=record.get("billed_node_hours", record.get("node_hours")),
        estimated_cost_usd=record.get("estimated_cost_usd"),
        note=note,
    )


def slurm_seconds(text: str) -> int | None:
    """Slurm's elapsed time ([D-][H:]M:SS) in seconds; None for anything else (INVALID)."""
    found = ELAPSED.fullmatch(text.strip())
    if found is None:
        return None
    days, hours, minutes, seconds = (int(part or 0) for part in found.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def jobs_table(rows: Sequence[JobRow]) -> Table:
    table = Table(title="jobs")
    for column in ("job", "run", "user", "state", "nodes", "time", "exit", "billed node-h", "est. cost", "note"):
        table.add_column(column)
    for row in rows:
        hours, cost = row.billed_node_hours, row.estimated_cost_usd
        table.add_row(
            row.job or "-",
            row.run or "-",
            row.user or "-",
            row.state,
            "" if row.nodes is None else str(row.nodes),
            row.finished_at or ("" if row.elapsed_seconds is None else _clock(row.elapsed_seconds)),
            "" if row.exit_code is None else str(row.exit_code),
            "" if hours is None else f"{hours:.3f}",
            "" if cost is None else f"${cost:.2f}",
            "; ".join(part for part in (IDLE_NOTE if row.gpus_idle else "", *slow_notes(row), row.note) if part),
        )
    return table


def slow_notes(row: JobRow) -> list[str]:
    """A running job's slow ranks, for its note (red)."""
    return [f"[red]{describe(slow)}[/red]" for slow in row.slow_ranks]


def _clock(seconds: int) -> str:
    """Seconds as squeue writes an elapsed time: D-HH:MM:SS, H:MM:SS, or M:SS under an hour."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02}:{minutes:02}:{seconds:02}"
    return f"{hours}:{minutes:02}:{seconds:02}" if hours else f"{minutes}:{seconds:02}"


def _ended_state(run: Run) -> tuple[str, str]:
    code = run.exit_code
    if code == 0:
        return "COMPLETED", ""
    if run.ended_by_time_limit:
        return "TIMEOUT", f"its time limit ({(run.job or {}).get('time_limit') or '?'}) ended it"
    if run.cancelled:
        return "CANCELLED", ""
    verdict = run.verdict or {}
    where = (
        ""
        if verdict.get("failed_rank") is None
        else f"rank {verdict['failed_rank']} on {verdict.get('failed_host') or '?'}"
    )
    why = verdict.get("job_error") or ""
    return "FAILED", ": ".join(part for part in (where, why[:120]) if part)


# --- logs ----------------------------------------------------------------------------------------
def run_logs(args: argparse.Namespace) -> int:
    desc, ssh, slurm = _connect(args)
    with ssh:
        run = _with_run_dir(patiently(lambda: resolve(desc, slurm, args.job), f"about {args.job}").check_readable())
        if args.follow:
            try:
                return follow(desc, ssh, slurm, run, debug=debugging(args))
            except KeyboardInterrupt:
                console.print(f"stopped following; {run.label} is not affected")
                return int(ExitCode.INTERRUPTED)
        text = slurm.run_unchecked(f"cat {q(f'{run.run_dir}/output.log')} 2>/dev/null").stdout
        print(text, end="" if text.endswith("\n") or not text else "\n", flush=True)
        if not text:
            console.print(f"[dim]{run.label} has no output yet[/dim]")
        if run.exit_code is None:
            console.print(_not_ended(slurm, run, args.job), markup=False, soft_wrap=True)
    return 0


def _not_ended(slurm: Slurm, run: Run, job: str) -> str:
    """What to say of a run without an exit status: it runs (or waits), or why it ended without one."""
    job_id = run.job_id or ""
    if job_id and patiently(lambda: slurm.job_state(job_id), f"about job {job_id}") is not None:
        return f"{run.label} has not ended: `logs {job} -f` follows it"
    ended = patiently(lambda: slurm.ended_jobs([job_id] if job_id else []), f"about job {job_id}")
    return f"{run.label} ended without an exit status: {without_status(ended.get(job_id))[1]}"


def _with_run_dir(run: Run) -> Run:
    if run.run_dir is None:
        raise OperatorError(f"{run.label} was not submitted with `dtrain launch`: it has no run directory")
    return run


# --- cancel --------------------------------------------------------------------------------------
def run_cancel(args: argparse.Namespace) -> int:
    desc, ssh, slurm = _connect(args)
    with ssh:
        # all of them first: a mistyped id cancels nothing
        runs = [patiently(lambda t=text: resolve(desc, slurm, t), f"about {text}") for text in dict.fromkeys(args.job)]
        stuck = [run.label for run in runs if not _cancel_one(slurm, run)]
    if stuck:
        raise OperatorError(
            f"{', '.join(stuck)} {'was' if len(stuck) == 1 else 'were'} cancelled but Slurm still holds "
            f"{'it' if len(stuck) == 1 else 'them'} after 30 s: processes may still be ending on the nodes",
            ExitCode.TIMED_OUT,
        )
    return 0


def _cancel_one(slurm: Slurm, run: Run) -> bool:
    """Cancel one job and wait for its end; False if Slurm still holds it after the wait."""
    job_id = run.job_id
    if job_id is None or patiently(lambda: slurm.job_state(job_id), f"about job {job_id}") is None:
        console.print(f"{run.label} has already ended" + (f" (exit {run.exit_code})" if run.status else ""))
        return True
    try:
        if not cancel_and_wait(slurm, job_id, run_dir=run.run_dir):
            return False
    except SlurmRefused as exc:
        owner = f"{run.owner}'s" if run.owner else "another user's"
        raise OperatorError(f"{run.label} is {owner}: Slurm refuses to cancel it ({exc})", exc.exit_code) from None
    # Slurm lets a job go only once the epilog has run on its nodes (and cancel_and_wait checked that
    # none of them failed): the epilog kills what Slurm's process tracking lost
    console.print(f"{run.label} cancelled: no process of it is left on any node")
    return True


# --- status --------------------------------------------------------------------------------------
def run_status(args: argparse.Namespace) -> int:
    desc, ssh, slurm = _connect(args)
    with ssh:
        nodes = slurm.nodes()
        queue = slurm.queue()
        reports = read_reports(desc, slurm)
        alerts = node_gpu_alerts(desc, slurm)
        running = running_run_ids(queue)
        slow = by_node(running_slow_ranks(queue, list_runs(desc, slurm, limit=0, also=running) if running else []))
    health, boot = reports["health"], reports["boot"]
    idle = for_cluster(desc, sum(not n.powered_down and not n.unregistered for n in nodes))
    if args.json:
        StatusDocument(
            nodes=[
                node_row(n, health.get(n.name), boot.get(n.name), alerts.get(n.name, []), slow.get(n.name, []))
                for n in nodes
            ],
            queue=[queued_row(job) for job in queue],
            summary=summary(nodes, queue),
            idle_usd_per_hour=None if idle.per_hour is None else str(idle.per_hour),
            idle_cost=idle.describe(),
        ).print()
    else:
        out.print(nodes_table(nodes, health, boot, alerts, slow))
        out.print(summary(nodes, queue))
        out.print(idle.describe(), highlight=False)
    usable = [n for n in nodes if not any(word in n.state for word in ("drain", "down", "fail"))]
    return 0 if usable else int(ExitCode.NOT_READY)


def node_row(
    node: NodeInfo,
    health: dict[str, str] | None,
    boot: dict[str, str] | None,
    gpu_alerts: list[str],
    slow_ranks: list[SlowRankRow] | None = None,
) -> NodeRow:
    return NodeRow(
        name=node.name,
        state=node.state,
        base_state=node.base_state,
        reason=node.reason,
        cpus=int(node.cpus) if node.cpus.isdigit() else None,
        gres=node.gres,
        powered_down=node.powered_down,
        not_responding=node.not_responding,
        unregistered=node.unregistered,
        health=health,
        boot=boot,
        gpu_alerts=gpu_alerts,
        slow_ranks=slow_ranks or [],
    )


def nodes_table(
    nodes: Sequence[NodeInfo],
    health: dict[str, dict[str, str]],
    boot: dict[str, dict[str, str]],
    alerts: dict[str, list[str]] | None = None,
    slow: dict[str, list[SlowRankRow]] | None = None,
) -> Table:
    alerts, slow = alerts or {}, slow or {}
    table = Table(title="nodes")
    # no boot column where no node wrote a boot report (the local cluster's nodes run no node-setup)
    boot_column = ["boot"] if boot else []
    alert_column = ["GPU alerts"] if alerts else []  # none where no GPU has an XID error or throttles
    slow_column = ["slow ranks"] if slow else []  # none where no running job has a slow rank
    columns = ("node", "state", "power", "reason", *boot_column, "health check", "checked", *alert_column, *slow_column)
    for column in columns:
        table.add_column(column)
    for node in nodes:
        report = health.get(node.name, {})
        checks = "; ".join(f"{k} {report[k]}" for k in HEALTH_CHECKS if report.get(k))
        verdict = "" if not report else ("[green]ok[/green]" if report.get("ok") == "1" else "[red]failed[/red]")
        table.add_row(
            node.name,
            node.base_state,
            power_column(node),
            "" if node.reason in ("", "none") else node.reason,
            *([boot_verdict(boot.get(node.name, {}))] if boot else []),
            f"{verdict} {checks}".strip(),
            _age(report.get("checked_at")),
            *(["[red]" + "; ".join(alerts.get(node.name, [])) + "[/red]"] if alerts else []),
            *([_slow_here(slow.get(node.name, []))] if slow else []),
        )
    return table


def _slow_here(rows: Sequence[SlowRankRow]) -> str:
    """`job 42 rank 1: 1.7x the median compute`, for each slow rank on a node; `drain NODE --requeue` moves them."""
    shown = [f"job {row.job} rank {row.rank}" + ("" if row.ratio is None else f": {row.ratio:.1f}x") for row in rows]
    return "[red]" + "; ".join(shown) + " (the median compute)[/red]" if shown else ""


def power_column(node: NodeInfo) -> str:
    if node.unregistered:
        return "[red]deallocated, never registered[/red]"
    if node.powered_down:
        return "powered down"
    # lost: an eviction or a failure; the reaper powers it down once Azure says it is deallocated
    return "[red]not responding[/red]" if node.not_responding else "on"


def _age(stamp: str | None) -> str:
    if not stamp:
        return ""
    try:
        seconds = (datetime.now(UTC) - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds()
    except ValueError:
        return stamp
    return f"{int(seconds)} s ago" if seconds < 120 else f"{int(seconds // 60)} min ago"


def summary(nodes: Sequence[NodeInfo], queue: Sequence[QueuedJob]) -> str:
    states: dict[str, int] = {}
    for node in nodes:
        key = node.base_state
        states[key] = states.get(key, 0) + 1
    powered = sum(node.powered_down for node in nodes)
    unregistered = sum(node.unregistered for node in nodes)
    running = sum(job.state == "RUNNING" for job in queue)
    pending = sum(job.state == "PENDING" for job in queue)
    node_text = ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "none"
    # the ones to look at: their first boot failed (the node's boot log says why)
    never = f" ({unregistered} deallocated, never registered)" if unregistered else ""
    return (
        f"{len(nodes)} nodes: {node_text}; {powered} powered down{never}; queue: {running} running, {pending} pending"
    )
