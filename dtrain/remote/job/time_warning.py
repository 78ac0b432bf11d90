#!/usr/bin/env python3
"""time-warning: the time limit is near; pass Slurm's warning on to the job's processes on every node.

Standard library only, Python 3.10+. `launch --warn-before` submits the job with
`sbatch --signal=B:USR1@SECONDS`: that long before the time limit (Slurm may send it up to a minute
earlier) Slurm signals the batch script alone, whose USR1 trap runs this tool on every node of the job
as one job step (`srun --overlap`, one task per node; with the docker runtime inside the job's
container there). On its node it sends SIGUSR1 to the processes of the job that catch it (the Spot
agent's way, with the agent's own function: spot_agent.py travels with the run's tools), which is what
a Spot eviction sends: our jobs save a checkpoint at the next step boundary and end (exit 75), and the
user's own code can catch the same signal. Ranks that have not yet installed their handler (the warning
can come while Python is still importing) are looked for again every second, for up to --within seconds.

  python3 time_warning.py --job "$SLURM_JOB_ID" --skip "$$" --skip-on "$SLURMD_NODENAME" --within 60

prints one report line, `NODE COUNT` (how many processes it signalled there), and exits 0: a node where
nothing catches the signal is no failure of the step. The batch script reads the step's reports with

  python3 time_warning.py --summarize NODES

which prints the job log's one line: how many processes on how many of the NODES nodes were signalled,
or that none catches it.
"""

import argparse
import os
import socket
import sys
import time

from spot_agent import signal_ranks


def forward(job_id, within_s, skip=()):
    """SIGUSR1 to the job's catching processes here, retried each second for within_s; their pids."""
    deadline = time.monotonic() + within_s
    while True:
        signalled = signal_ranks(job_id, skip=skip)
        if signalled or time.monotonic() >= deadline:
            return signalled
        time.sleep(1)


def node_name():
    """The Slurm node this runs on (a container's hostname is its own: the step passes SLURMD_NODENAME in)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def summary(reports, nodes):
    """The job log's line from the nodes' `NODE COUNT` reports (a node that sent none signalled nothing)."""
    counts = {}
    for line in reports:
        words = line.split()
        if len(words) == 2 and words[1].isdigit():
            counts[words[0]] = int(words[1])
    total = sum(counts.values())
    if not total:
        return f"[job] time warning: no process catches SIGUSR1 on the job's {nodes} node(s); the time limit ends it"
    reached = sorted(node for node, count in counts.items() if count)
    where = f"{len(reached)} of {nodes} node(s) ({','.join(reached)})"
    return f"[job] time warning: SIGUSR1 sent to {total} processes on {where}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="time_warning.py", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--job", help="the Slurm job id: signal its processes on this node")
    what.add_argument("--summarize", type=int, metavar="NODES", help="read the nodes' reports on stdin")
    parser.add_argument("--skip", type=int, action="append", default=[], help="a pid not to signal")
    parser.add_argument("--skip-on", help="the node whose pids --skip names (the batch script's); default: any")
    parser.add_argument("--within", type=float, default=60.0, help="give up after this many seconds (default 60)")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        print(summary(sys.stdin, args.summarize))
        return 0
    here = node_name()
    skip = args.skip if args.skip_on in (None, here) else []
    print(here, len(forward(args.job, args.within, skip=skip)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
