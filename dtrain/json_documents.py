"""The schemas of what `--json` prints: one pydantic model per command (`jobs`, `status`, `cost`, `cost --by`,
`doctor`) and the error document every one of them prints instead when it fails. Runs on the
operator's machine.

Every field has one type, whichever row or case it comes from; a value that is absent is null, never
a missing key. A script reads one JSON document on stdout: the command's on success, `ErrorDocument`
on failure (with the exit status the command returns). `Model.model_json_schema()` gives the JSON
Schema of each (docs/operator.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Document(BaseModel):
    """A --json document: no key beyond the schema's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def print(self) -> None:
        print(self.model_dump_json(indent=2), flush=True)


# --- failure: every command --------------------------------------------------------------------
class Failure(Document):
    message: str  # the text of the `error:` line on stderr
    exit_status: int  # the command's exit status (dtrain/errors.py ExitCode)


class ErrorDocument(Document):
    error: Failure


# --- jobs (and the queue of status) -----------------------------------------------------------
class SlowRankRow(Document):
    """A rank of a running job whose compute per step is persistently above its peers' (the job's
    slow_ranks.json; docs/operator.md, "Slow ranks")."""

    job: str | None  # the Slurm job id
    run: str | None  # the run id
    rank: int
    host: str  # the node it runs on: `dtrain drain HOST --requeue` moves the job off it
    compute_s: float | None  # its mean seconds per step of data, forward and loss, in the window that named it
    median_s: float | None  # the median of the other ranks' in that window
    ratio: float | None  # compute_s / median_s
    since: str | None  # ISO 8601 (UTC): the first of the log windows that made it slow
    since_step: int | None  # that window's step


class JobRow(Document):
    """A job Slurm holds (pending, running) or a run that has ended; the same keys for both."""

    job: str | None  # Slurm's job id; null for a run whose id was not recorded
    run: str | None  # the run id (the Slurm job's name)
    state: str  # Slurm's state while it holds the job; COMPLETED, FAILED, CANCELLED, TIMEOUT or ENDED after;
    # UNREADABLE: another user's ended run (`jobs --all`), whose directory is theirs alone
    in_queue: bool  # Slurm holds it (pending, running, completing)
    user: str | None  # who submitted it
    nodes: int | None  # nodes asked for (pending) or allocated
    elapsed_seconds: int | None  # how long it has run (in the queue), or its last attempt ran (ended)
    finished_at: str | None  # ISO 8601, once it has ended
    exit_code: int | None  # once it has ended
    node_hours: float | None  # every attempt's nodes x time, once it has ended (run.json)
    billed_node_hours: float | None  # what it is charged for: its share of those nodes (GPUs held) x time
    estimated_cost_usd: float | None  # of the billed node-hours at the list price, where one is known
    note: str  # why it waits or where it runs (in the queue); why it ended so (ended)
    # running and holding GPUs: whether all of them stayed idle through the idle window (Prometheus's
    # DCGM_FI_DEV_GPU_UTIL at most 5 %); null when unknown, not running that long, or not a GPU job
    gpus_idle: bool | None = None
    slow_ranks: list[SlowRankRow] = Field(default_factory=list)  # running: its slow ranks now, if any


class JobsDocument(Document):
    jobs: list[JobRow]  # those Slurm holds, then the ended runs, newest first


# --- status -------------------------------------------------------------------------------------
class NodeRow(Document):
    name: str
    state: str  # sinfo's long state, flags included (`idle~`: powered down)
    base_state: str  # the state without the flags
    reason: str  # the drain or down reason; "none" when there is none
    cpus: int | None
    gres: str  # sinfo's generic resources (`gpu:8`), "(null)" for none
    powered_down: bool
    not_responding: bool  # its slurmd does not answer (`*`): off for all anyone knows until the reaper asks Azure
    unregistered: bool  # deallocated by the head node's reaper: it never registered with Slurm
    health: dict[str, str] | None  # its last health check report (key=value lines), if any
    boot: dict[str, str] | None  # its last boot report (node-setup's steps), if any
    gpu_alerts: list[str] = Field(default_factory=list)  # XID errors and throttling of its GPUs (Prometheus)
    slow_ranks: list[SlowRankRow] = Field(default_factory=list)  # the running jobs' slow ranks on this node


class StatusDocument(Document):
    nodes: list[NodeRow]
    queue: list[JobRow]
    summary: str  # the line the table ends with
    idle_usd_per_hour: str | None  # what the cluster bills per hour with no job running; null: unknown
    idle_cost: str  # the line saying so: standing part, GPU nodes on, until autostop


# --- cost ----------------------------------------------------------------------------------------
class CostPrices(Document):
    table: str  # where the prices were read: the table's file and date, or the live API
    as_of: str  # ISO date
    price_type: str
    source: str
    query: str  # the Retail Prices API's $filter the figures answer


class CostItem(Document):
    item: str
    size: str
    count: int
    basis: str  # the unit price as the table gives it
    usd_per_hour: str  # an exact decimal string
    source: str | None  # the price's source (null for a row that costs nothing)
    estimate: str | None  # why the figure is not a direct reading of the API


class CostIdle(Document):
    """What the stack bills per hour with no job running, and its running GPU nodes until autostop."""

    standing_usd_per_hour: str  # head node, NFS server and disks, jumpbox, registry (exact decimal string)
    gpu_node_usd_per_hour: str  # one on-demand GPU node
    gpu_nodes_on: int  # on-demand GPU nodes running (the estimate's; --live: Slurm's)
    usd_per_hour: str  # standing plus the nodes on
    autostop_minutes: int  # idle minutes before Slurm deallocates a node; 0: never
    until_autostop_usd: str | None  # the nodes on, idle until autostop; null when autostop is off


class CostDocument(Document):
    stack_file: str
    region: str
    currency: str
    prices: CostPrices
    rows: list[CostItem]
    total_usd_per_hour: str  # the exact sum of the rows, a decimal string
    idle: CostIdle  # the standing cluster with no job running
    not_included: list[str]


class UsageCostRow(Document):
    """One person's (or Slurm account's) jobs in the window, added up (`cost --by`)."""

    name: str  # the user or account; "total" for the sum of the rows
    jobs: int
    node_hours: str  # nodes x time, an exact decimal string (hours to 4 places)
    gpu_hours: str  # GPUs (AllocTRES gres/gpu) x time
    billed_node_hours: str  # what the jobs are charged for: their GPUs' share of their nodes x time
    usd: str | None  # billed node-hours at their partition's price (Spot for the Spot partition); null: unknown


class UsageCostDocument(Document):
    by: str  # user or account
    cluster: str
    since: str  # ISO 8601, UTC
    until: str  # the login node's clock when sacct was read
    currency: str
    prices: str  # where the price per node-hour comes from
    rows: list[UsageCostRow]  # most GPU-hours first
    total: UsageCostRow


# --- doctor --------------------------------------------------------------------------------------
class DoctorCheck(Document):
    name: str  # e.g. "provider Microsoft.KeyVault", "quota standardNDSH100v5Family in eastus"
    ok: bool
    detail: str  # what was found
    fix: str | None  # the command that fixes it; null when it is ok


class DoctorDocument(Document):
    stack_file: str
    region: str
    subscription: str | None  # the subscription checked; null when none could be chosen
    subscription_source: str | None  # where it was chosen from: --subscription, ARM_SUBSCRIPTION_ID, ...
    principal: str | None  # who is signed in; null without a credential
    ok: bool  # every check passed (exit status 0)
    checks: list[DoctorCheck]
