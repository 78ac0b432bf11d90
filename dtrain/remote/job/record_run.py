#!/usr/bin/env python3
"""record-run: add one attempt of a job to its run record, run.json, with node-hours and the estimated cost.

Standard library only, Python 3.10+: the batch script (job.sh) runs it on the first node when an attempt
ends, before the run directory is uploaded.

  python3 record_run.py --run-dir RUN_DIR --nodes 2 --attempt 1 --started-at EPOCH_SECONDS --exit-code 0 \
      --partition gpu --alloc-tres cpu=4,mem=8G,node=2,billing=4,gres/gpu=2 --node-cpus 96

The record names whose run it is: the Slurm user and account the job ran as (SLURM_JOB_USER,
SLURM_JOB_ACCOUNT). A job is charged what it was allocated, not its whole nodes: its GPUs over the GPUs
of a node (job.json's node_gpus), or on nodes without GPUs its CPUs over a node's (--node-cpus), in
node-equivalents ("billed nodes"). The allocation is Slurm's AllocTRES (job.sh reads it with squeue),
which counts the job's GPUs (gres/gpu: slurm.conf's AccountingStorageTRES, the same figure slurmdbd keeps
for sacct).
A job that holds its nodes exclusively (job.json's exclusive: every GPU of a node, or --exclusive) is
charged whole nodes. Where the allocation cannot be read, the request launch wrote in job.json stands in
for it, which is what `launch` quoted.

The price comes from the run's job.json, where `launch` wrote the price per node-hour of each partition
the job may run in (on-demand, Spot; from the price table of `python -m dtrain cost`), so the job needs
no network and no table of its own: each attempt is priced at its own partition's price. A requeued job
runs the batch script again: each attempt is kept under its number, and the totals add every attempt's
node-hours and cost, because every attempt held its nodes. An attempt that ended with status 75 was
preempted (a Spot eviction: it saved a checkpoint and the node agent requeued it); the evictions the
agent noted in the run directory (evictions.json) are listed too, and so is what the gate before a
multi-node attempt measured and which nodes it left out (gate/summary.json, dtrain/jobs/node_gate.py).
An attempt whose first node was lost (a Spot eviction that the agent missed: its batch script ended
with the machine) recorded nothing; the next attempt to end adds it, from the line job.sh wrote as it
started (attempts.started), with "lost": true, no exit status, and its time up to the start of the
attempt after it. The cost is an estimate: list price times the allocation's wall time, without the
minutes a node spends starting or being power-saved (a Spot VM's actual price moves under its max
price; the table's is the list price when it was read).

Exit status: 0 written; 2 bad arguments or an unreadable job.json; 1 run.json could not be written.
"""

import argparse
import getpass
import json
import os
import sys
import time
from datetime import datetime, timezone

RECORD = "run.json"
JOB = "job.json"
EVICTIONS = "evictions.json"  # written by the Spot agent (spot_agent.py)
GATE_SUMMARY = os.path.join("gate", "summary.json")  # node_gate.py's, for this attempt (job.sh clears it)
STARTED = "attempts.started"  # job.sh appends "ATTEMPT STARTED_AT PARTITION" as each attempt starts
PREEMPTED_EXIT_CODE = 75  # training.exit_status.ExitCode.PREEMPTED (stands alone; tests/test_layout.py checks)


def _iso(epoch):
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: UP017 (3.10)


def _read(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def partition_price(job, partition):
    """The price per node-hour of the partition the attempt ran in (job.json), else the cluster's."""
    prices = job.get("prices_per_node_hour_usd") or {}
    return prices.get(partition, job.get("price_per_node_hour_usd"))


def parse_tres(text):
    """Slurm's TRES string (cpu=4,mem=8G,node=2,billing=4,gres/gpu=2) -> {name: count} of its whole numbers."""
    counts = {}
    for item in (text or "").strip().split(","):
        name, _, value = item.partition("=")
        if value.isdigit():
            counts[name.strip()] = int(value)
    return counts


def billed_nodes(job, nodes, alloc_tres=None, node_cpus=None):
    """The node-equivalents an attempt is charged, and why: a share of its nodes by what it was allocated."""
    node_gpus = job.get("node_gpus") or 0
    # whole nodes; so is a job.json from before node_gpus, as such jobs were charged then
    if job.get("exclusive") or "node_gpus" not in job:
        return float(nodes), "whole nodes"
    tres = parse_tres(alloc_tres)
    if node_gpus and "gres/gpu" in tres:
        return tres["gres/gpu"] / node_gpus, f"{tres['gres/gpu']} GPUs of {node_gpus} a node (allocated)"
    cpus = int(node_cpus) if str(node_cpus or "").isdigit() and int(node_cpus) else None
    if not node_gpus and cpus and "cpu" in tres:
        return tres["cpu"] / cpus, f"{tres['cpu']} CPUs of {cpus} a node (allocated)"
    asked = job.get("gpus_per_node") or 0
    if node_gpus and asked:  # the allocation could not be read: the request, as launch quoted it
        return nodes * asked / node_gpus, f"{nodes * asked} GPUs of {node_gpus} a node (as asked)"
    return float(nodes), "whole nodes"


def attempt_entry(nodes, attempt, started_at, finished_at, exit_code, partition=None, price=None, billed=None):
    seconds = max(0, finished_at - started_at)
    node_hours = round(nodes * seconds / 3600, 6)
    share, basis = billed or (float(nodes), "whole nodes")
    billed_hours = round(share * seconds / 3600, 6)
    return {
        "attempt": attempt,
        "started_at": _iso(started_at),
        "finished_at": _iso(finished_at),
        "seconds": seconds,
        "nodes": nodes,
        "node_hours": node_hours,
        "billed_nodes": round(share, 6),
        "billed_by": basis,
        "billed_node_hours": billed_hours,
        "exit_code": exit_code,
        "preempted": exit_code == PREEMPTED_EXIT_CODE,
        "partition": partition,
        "price_per_node_hour_usd": price,
        "estimated_cost_usd": None if price is None else round(billed_hours * price, 4),
    }


def lost_attempts(run_dir, job, nodes, attempt, started_at, recorded, billed=None):
    """Entries for the attempts before this one that started (attempts.started) and never recorded
        themselves: each is charged from its start to the next attempt's start, for this attempt's allocation
    (the same request)."""
    starts = {}
    try:
        with open(os.path.join(run_dir, STARTED)) as handle:
            for line in handle:
                fields = line.split()
                if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit():
                    starts[int(fields[0])] = (int(fields[1]), fields[2])
    except OSError:
        return []
    starts.setdefault(attempt, (started_at, None))
    entries = []
    for number in sorted(starts):
        if number >= attempt or number in recorded:
            continue
        begun, partition = starts[number]
        ended = min(start for later, (start, _) in starts.items() if later > number)
        price = partition_price(job, partition)
        entry = attempt_entry(nodes, number, begun, ended, None, partition, price, billed)
        entries.append({**entry, "lost": True})
    return entries


def attempt_gate(run_dir, attempt):
    """What the gate measured before this attempt trained, and which nodes it left out (None: no gate ran)."""
    try:
        summary = _read(os.path.join(run_dir, GATE_SUMMARY))
    except (OSError, ValueError):
        return None  # a damaged summary: the log still has the gate's lines
    if not isinstance(summary, dict) or summary.get("attempt") != attempt:
        return None
    keys = ("seconds", "job_allreduce_gbs", "thresholds", "excluded", "note")
    return {key: summary.get(key) for key in keys} | {"nodes": [n.get("node") for n in summary.get("nodes", [])]}


def _total_cost(attempts, fallback_price, billed_hours):
    """The sum of the attempts' costs; records of older jobs, without a price per attempt, use the run's."""
    costs = [a.get("estimated_cost_usd") for a in attempts]
    if all(cost is not None for cost in costs):
        return round(sum(costs), 4)
    return None if fallback_price is None else round(billed_hours * fallback_price, 4)


def build_record(job, previous, entry, evictions=(), lost=(), owner=(None, None)):
    """The run record: the request's identity and whose it is (owner: the Slurm user and account the job ran
    as), every attempt so far (lost ones too), its evictions, and their totals."""
    added = [entry, *lost]
    numbers = {a["attempt"] for a in added}
    attempts = [a for a in (previous or {}).get("attempts", []) if a.get("attempt") not in numbers]
    attempts = sorted([*attempts, *added], key=lambda a: a["attempt"])
    node_hours = round(sum(a["node_hours"] for a in attempts), 6)
    billed_hours = round(sum(a.get("billed_node_hours", a["node_hours"]) for a in attempts), 6)
    price = job.get("price_per_node_hour_usd")
    return {
        "run_id": job.get("run_id"),
        "framework": job.get("framework"),
        "cluster": job.get("cluster"),
        "user": owner[0],  # what `cost --by user` groups it by (sacct's User)
        "account": owner[1],
        "gpu_sku": job.get("gpu_sku"),
        "region": job.get("region"),
        "attempts": attempts,
        "exit_code": entry["exit_code"],
        "node_hours": node_hours,
        "billed_node_hours": billed_hours,
        "price_per_node_hour_usd": price,
        "price_source": job.get("price_source"),
        "estimated_cost_usd": _total_cost(attempts, price, billed_hours),
        "evictions": list(evictions),
    }


def write_atomically(path, data):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--started-at", type=int, required=True, help="the attempt's start, in seconds since 1970")
    parser.add_argument("--exit-code", type=int, required=True)
    parser.add_argument("--partition", help="the Slurm partition the attempt ran in (prices it)")
    parser.add_argument("--alloc-tres", help="the job's AllocTRES (squeue -O tres-alloc): what it is charged for")
    parser.add_argument("--node-cpus", help="CPUs of a node (CPUTot): prices a share of a CPU node")
    args = parser.parse_args(argv)
    try:
        job = _read(os.path.join(args.run_dir, JOB))
    except (OSError, ValueError) as exc:
        print(f"record-run: cannot read {JOB}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(job, dict):
        print(f"record-run: no {JOB} in {args.run_dir}", file=sys.stderr)
        return 2
    path = os.path.join(args.run_dir, RECORD)
    try:
        previous = _read(path)
    except (OSError, ValueError):
        previous = None  # a damaged record: this attempt starts a new one rather than failing the upload
    price = partition_price(job, args.partition)
    finished_at = int(time.time())
    billed = billed_nodes(job, args.nodes, args.alloc_tres, args.node_cpus)
    entry = attempt_entry(
        args.nodes, args.attempt, args.started_at, finished_at, args.exit_code, args.partition, price, billed
    )
    entry["alloc_tres"] = (args.alloc_tres or "").strip() or None  # what Slurm allocated, as it said it
    if gate := attempt_gate(args.run_dir, args.attempt):
        entry["gate"] = gate
    try:
        evictions = _read(os.path.join(args.run_dir, EVICTIONS)) or []
    except (OSError, ValueError):
        evictions = []  # the agent's note is a bonus: a damaged one does not lose the record
    recorded = {a.get("attempt") for a in (previous or {}).get("attempts", [])}
    lost = lost_attempts(args.run_dir, job, args.nodes, args.attempt, args.started_at, recorded, billed)
    # the batch script's environment: Slurm's names for who the job ran as, else this process's own
    owner = (os.environ.get("SLURM_JOB_USER") or getpass.getuser(), os.environ.get("SLURM_JOB_ACCOUNT"))
    record = build_record(job, previous, entry, evictions, lost, owner)
    try:
        write_atomically(path, record)
    except OSError as exc:
        print(f"record-run: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    cost = record["estimated_cost_usd"]
    print(
        f"{record['node_hours']:.4f} node-hours, billed {record['billed_node_hours']:.4f} ({billed[1]})"
        + ("" if cost is None else f", estimated ${cost:.2f}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
