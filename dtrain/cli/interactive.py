"""Into the cluster by hand: `ssh NODE|JOB`, `exec JOB -- CMD`, `alloc [-- CMD]`.

  ssh    a shell (or a command) on a node, through the jump host; JOB means the first node of a
         running job's allocation. Node addresses come from Slurm (where each slurmd registered from).
  exec   a command inside a running job's allocation, one per node (`srun --jobid --overlap`): what
         a job's GPUs are doing, with the job's own cgroup and devices.
  alloc  an interactive allocation (`salloc`) on the login node: a shell there, from which `srun`
         runs on the allocated nodes; or, after `--`, a command run once with the allocation.
Each takes the terminal while it runs and exits with the remote command's status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterable

from dtrain.cli.allocation_flags import add_allocation_arguments, plan_from_args
from dtrain.cli_entry import add_cluster_option, arg_type, non_empty
from dtrain.cluster.description import ClusterDescription, load
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH, SSHFailure, Target, explain_ssh_failure, q
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.allocation import cost_line, salloc_flags
from dtrain.jobs.runs import Run, check_job_reference, resolve
from dtrain.jobs.submit import node_hour_price
from dtrain.ui import make_console

console = make_console()


def examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  python -m dtrain {line}" for line in lines)


def configure(commands: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    ssh = commands.add_parser(
        "ssh",
        help="a shell (or a command) on a node, or on a running job's first node",
        description="SSH to a node through the jump host. TARGET is a node name, or a job (Slurm job id or run "
        "id): the first node of its allocation, while it runs. The words after `--` are one line for the "
        "node's shell, joined with spaces as ssh joins them.",
        epilog=examples("ssh node-0", "ssh 42 -- nvidia-smi", "ssh node-0 -- 'free -g; df -h /nvme'"),
        formatter_class=raw,
    )
    ssh.add_argument("target", type=non_empty, metavar="NODE|JOB")
    ssh.add_argument("command", nargs=argparse.REMAINDER, help="-- then a command to run instead of a shell")
    run_in = commands.add_parser(
        "exec",
        help="run a command inside a running job's allocation, once per node (srun --overlap)",
        description="Run a command on every node of a running job, inside its allocation (its GPUs, its "
        "cgroup), alongside the job: `srun --jobid JOB --overlap --ntasks-per-node 1`. Each line is prefixed "
        "with the task's number; the exit status is srun's.",
        epilog=examples("exec 42 -- nvidia-smi", "exec 42 -- sh -c 'free -g; df -h /nvme'"),
        formatter_class=raw,
    )
    run_in.add_argument("job", type=arg_type(check_job_reference), metavar="JOB", help="Slurm job id or run id")
    run_in.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    alloc = commands.add_parser(
        "alloc",
        help="an interactive allocation (salloc): a shell with nodes and GPUs held for you",
        description="Ask Slurm for an allocation, checked and priced as `launch` does, and open a shell on the "
        "login node that holds it (`srun CMD` runs on its nodes; `exit` gives it back). After `--`, run that "
        "command once with the allocation instead, and give it back when it ends.",
        epilog=examples("alloc --gpus 1 --time 2:00:00", "alloc --nodes 2 -- srun hostname"),
        formatter_class=raw,
    )
    add_allocation_arguments(alloc)
    alloc.add_argument("command", nargs=argparse.REMAINDER, help="-- then a command to run instead of a shell")
    for parser, handler in ((ssh, run_ssh), (run_in, run_exec), (alloc, run_alloc)):
        add_cluster_option(parser)
        parser.set_defaults(handler=handler)


def _command(words: list[str], what: str, required: bool, shell_line: bool = False) -> str:
    """The words after `--`, each quoted (an argv for srun, salloc); or, with shell_line, joined with spaces
    into one line for the remote shell, as ssh joins them (`ssh NODE -- 'a; b'` runs a, then b)."""
    words = words[1:] if words[:1] == ["--"] else words
    if required and not words:
        raise OperatorError(f"{what} needs a command after `--`, e.g. -- nvidia-smi")
    return " ".join(words if shell_line else (q(word) for word in words))


def _interactive(ssh: SSH, target: Target, command: str) -> int:
    """ssh with the terminal (a pseudo-terminal when there is one): the remote command's exit status."""
    tty = ["-t"] if sys.stdin.isatty() and sys.stdout.isatty() else []
    *ssh_argv, alias, _ = ssh.argv(target, command)
    proc = subprocess.run([*ssh_argv, *tty, alias, *([command] if command else [])])
    if proc.returncode == 255:
        raise SSHFailure(explain_ssh_failure(target.label, "", ssh.desc))
    return proc.returncode


def _running_job(desc: ClusterDescription, slurm: Slurm, text: str, run: Run | None = None) -> str:
    run = run or resolve(desc, slurm, text)
    state = slurm.job_state(run.job_id) if run.job_id else None
    if state != "RUNNING":
        raise OperatorError(f"{run.label} is not running ({state or 'ended'}): it holds no nodes", ExitCode.BAD_INPUT)
    assert run.job_id is not None
    return run.job_id


def run_ssh(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    command = _command(args.command, "ssh", required=False, shell_line=True)
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        addresses = slurm.node_addresses()
        node = args.target if args.target in addresses else _first_node_of_job(desc, slurm, args.target, addresses)
        ssh.addresses.update(addresses)
        return _interactive(ssh, ssh.node(node), command)


def _first_node_of_job(desc: ClusterDescription, slurm: Slurm, target: str, nodes: Iterable[str]) -> str:
    """The first node of the running job or run `target`; refused, naming the nodes, when it is neither."""
    try:
        run = resolve(desc, slurm, target)
    except OperatorError:
        raise OperatorError(
            f"{target} is neither a node of cluster {desc.name} ({', '.join(sorted(nodes)) or 'none'}) nor a job "
            "or a run (`dtrain jobs` lists them)"
        ) from None
    return slurm.job_nodes(_running_job(desc, slurm, target, run))[0]


def run_exec(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    command = _command(args.command, "exec", required=True)
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        job_id = _running_job(desc, slurm, args.job)
        every_node = f'--nodes="$(squeue --noheader --jobs={q(job_id)} --format=%D)" --ntasks-per-node=1'
        srun = f"srun --jobid={q(job_id)} --overlap --label {every_node} {command}"
        return _interactive(ssh, ssh.login, slurm.script(srun))


def run_alloc(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    command = _command(args.command, "alloc", required=False)
    alloc = plan_from_args(desc, args)
    price, source = node_hour_price(desc)
    console.print(f"allocation: {alloc.describe(desc)}")
    console.print(cost_line(alloc, desc, price, source))
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        salloc = " ".join(["salloc", *salloc_flags(alloc, slurm.access.partition), command]).strip()
        return _interactive(ssh, ssh.login, slurm.script(salloc))
