#!/usr/bin/env python3
"""time-warning: the time limit is near; pass Slurm's warning on to the job's training processes.

Standard library only, Python 3.10+. `launch --warn-before` submits the job with
`sbatch --signal=B:USR1@SECONDS`: that long before the time limit (Slurm may send it up to a minute
earlier) Slurm signals the batch script alone, whose USR1 trap starts this tool in the background. It
sends SIGUSR1 to this node's processes of the job that catch it (the Spot agent's way, with the agent's
own function: spot_agent.py travels with the run's tools), which is what a Spot eviction sends: our
jobs save a checkpoint at the next step boundary and end (exit 75), and the user's own code can catch
the same signal. Ranks that have not yet installed their handler (the warning can come while Python
is still importing) are looked for again every second, for up to --within seconds.

  python3 time_warning.py --job "$SLURM_JOB_ID" --skip "$$" --within 60

Prints what it signalled; exit status 0 when a process was signalled, 1 when none caught the signal.
"""

import argparse
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="time_warning.py", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the Slurm job id")
    parser.add_argument("--skip", type=int, action="append", default=[], help="a pid not to signal (the batch shell)")
    parser.add_argument("--within", type=float, default=60.0, help="give up after this many seconds (default 60)")
    args = parser.parse_args(argv)
    signalled = forward(args.job, args.within, skip=args.skip)
    if not signalled:
        print(f"[job] time warning: no process of job {args.job} catches SIGUSR1; the time limit ends it")
        return 1
    print(f"[job] time warning: SIGUSR1 sent to {len(signalled)} training processes (pids {signalled})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
