#!/usr/bin/env python3
"""srun-ssh: the `ssh` that horovodrun uses inside a Slurm job: each remote worker becomes a job step.

Standard library only, Python 3.10+. The batch script (job.sh) links it as `ssh` in a directory it
puts first on PATH before it runs horovodrun, so that horovodrun's

  ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no HOST [-p PORT] [-i FILE] \\
      [-o ConnectTimeout=10] COMMAND...

(its connectivity check runs COMMAND `true`; its workers and task servers run the real commands)
becomes

  srun --jobid=$SLURM_JOB_ID --overlap --nodes=1 --ntasks=1 --nodelist=HOST --mem=0 --export=ALL \
      bash -c "trap '' USR1; COMMAND"

Slurm then tracks every worker and kills it with the job (scancel, time limit, a failed node), and no
SSH server or key is needed between the nodes. As with ssh: options may come before or after HOST,
COMMAND is the remaining words joined with spaces and run by a shell (`bash -c`), and every error of
the transport (srun's own failures included, through SLURM_EXIT_ERROR) exits with status 255; otherwise
the exit status is COMMAND's. -o, -p and -i are accepted and ignored (srun needs none of them); any
other option is refused, and so is a call outside a Slurm job (no SLURM_JOB_ID). HOST must be a Slurm
node name (the hostfile is made from the allocation's node names).

The step gets all of the job's resources on the node (--overlap, so that a node's workers share them;
--mem=0: all of the job's memory there; GPUs: a step gets all of the job's GRES by default), and the
variables of the batch step that srun would read as the step's shape (tasks, nodes, CPUs, memory or
GPUs per task, distribution) are left out of its environment.
"""

import os
import re
import sys

EXIT_SSH = 255  # what ssh exits with when it cannot run the command
# An eviction's SIGUSR1 (spot_agent.py) is for the training ranks, which catch it; srun forwards it to its
# step's tasks: the step's shell and horovod's helpers ignore it (and pass that on to the ranks, which catch it).
IGNORE_EVICTION_SIGNAL = "trap '' USR1; "
OPTIONS_WITH_VALUE = ("-o", "-p", "-i")  # every option horovod 0.28.1's ssh command lines carry
HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# srun reads these as options; in the batch step they describe the whole job (sbatch sets them), and a
# worker's step must not inherit that shape (e.g. --ntasks-per-node=8 for a one-task step).
STEP_SHAPE_VARIABLES = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NTASKS_PER_CORE",
    "SLURM_NTASKS_PER_SOCKET",
    "SLURM_NTASKS_PER_GPU",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_DISTRIBUTION",
    "SLURM_DIST_PLANESIZE",
    "SLURM_CPUS_PER_TASK",
    "SRUN_CPUS_PER_TASK",
    "SLURM_TRES_PER_TASK",
    "SLURM_CPUS_PER_GPU",
    "SLURM_CPU_BIND",
    "SLURM_THREADS_PER_CORE",
    "SLURM_OVERCOMMIT",
    "SLURM_MEM_PER_NODE",
    "SLURM_MEM_PER_CPU",
    "SLURM_MEM_PER_GPU",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_SOCKET",
    "SLURM_GPUS_PER_TASK",
    "SLURM_GRES",
    "SLURM_STEP_GRES",
)


class SshUsageError(Exception):
    pass


def parse_ssh_args(argv):
    """ssh's arguments -> (host, command), the way OpenSSH reads them: options before and after the
    host, up to the first other word or `--`; the rest, joined with spaces, is the command."""
    host = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            if host is not None:
                break
            host = arg
            i += 1
            continue
        if arg[:2] not in OPTIONS_WITH_VALUE:
            raise SshUsageError(f"unknown option {arg} (this ssh runs commands as Slurm job steps)")
        if len(arg) == 2 and i + 1 >= len(argv):
            raise SshUsageError(f"option {arg} needs a value")
        i += 2 if len(arg) == 2 else 1  # `-p 22` or `-p22`
    if host is None:
        if i >= len(argv):
            raise SshUsageError("no host given")
        host, i = argv[i], i + 1
    host = host.rsplit("@", 1)[-1]  # user@host: a step runs as the job's user, whatever is asked
    if not HOSTNAME.fullmatch(host):
        raise SshUsageError(f"{host!r} is not a node name")
    command = " ".join(argv[i:])
    if not command.strip():
        raise SshUsageError(f"no command for {host}: an interactive session cannot be a job step")
    return host, command


def srun_argv(job_id, host, command):
    return [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={host}",
        "--mem=0",
        "--export=ALL",
        "bash",
        "-c",
        IGNORE_EVICTION_SIGNAL + command,
    ]


def step_environment(environ):
    """The environment srun runs with (and, through --export=ALL, the worker): the batch step's, without
    what would reshape the step, and with srun's own errors exiting 255, as ssh's do."""
    env = {key: value for key, value in environ.items() if key not in STEP_SHAPE_VARIABLES}
    env["SLURM_EXIT_ERROR"] = str(EXIT_SSH)
    return env


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):
        print(__doc__.strip())
        return 0
    try:
        host, command = parse_ssh_args(argv)
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if not job_id.isdigit():
            raise SshUsageError("not inside a Slurm job (SLURM_JOB_ID is not set): run it from a batch script")
        os.execvpe("srun", srun_argv(job_id, host, command), step_environment(os.environ))
    except SshUsageError as exc:
        print(f"ssh (srun_ssh.py): error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"ssh (srun_ssh.py): error: cannot run srun: {exc.strerror or exc}", file=sys.stderr)
    return EXIT_SSH


if __name__ == "__main__":
    sys.exit(main())
