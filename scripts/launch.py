"""`launch`: submit a training run to Slurm over SSH (through the jump host), then follow it or detach.

  python -m scripts launch --framework pytorch --nodes 2 -- --data synthetic --steps 100

The steps, each a module: submit (scripts/submit.py: checks, run directory, job.sh, sbatch), follow
(scripts/follow.py: the log until the job ends, and its exit), results (uploaded by the job itself on
the cluster, scripts/remote/upload_results.py). Following is the default on a terminal; Ctrl-C then
asks whether to cancel the job or detach from it.
"""

from __future__ import annotations

import argparse
import sys

from infra.contract import FRAMEWORKS
from scripts.cli import add_cluster_option, arg_type, debugging, int_between, non_empty
from scripts.cluster import load
from scripts.follow import ask_cancel_or_detach, follow
from scripts.launcher_noise import without_launcher_tracebacks
from scripts.runs import Run
from scripts.slurm import Slurm
from scripts.sshutil import SSH
from scripts.submit import LaunchOptions, Submission, check_run_id, submit
from scripts.ui import make_console

console = make_console()

EPILOG = """\
Everything after `--` goes to the job (python -m training.<framework> --help, or with --model-parallel
python -m training.model_parallel --help). Horovod jobs run with horovodrun on a hostfile made from the
allocation; `--backend ddp` and `--model-parallel` (PyTorch) run torchrun under srun, one per node.
With --follow (the default on a terminal) the exit status is the job's own.

examples:
  python -m scripts launch --framework pytorch -- --data synthetic --steps 100
  python -m scripts launch --framework pytorch --nodes 2 --requeue -- --backend ddp --data imagenet \\
      --data-dir /shared/data/imagenet --epochs 90
  python -m scripts launch --framework keras --detach -- --data synthetic --epochs 1
  python -m scripts launch --framework pytorch --nodes 2 --gpus-per-node 8 --model-parallel -- \\
      --model gpt-1.3b --pp 2 --dp-shard -1 --precision bf16 --steps 200
"""


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "launch",
        help="submit a training job to Slurm and follow its output",
        description="Submit a data-parallel training job with sbatch (through the jump host) and stream every "
        "rank's output, prefixed [rank|host], until it ends. The run's logs, metrics, trained model (model/), "
        "TensorBoard events, summary.png and run.json (node-hours, estimated cost) reach the results container "
        "from the cluster, whether or not you stay attached.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_option(parser)
    parser.add_argument("--framework", required=True, choices=FRAMEWORKS)
    parser.add_argument("--nodes", type=int_between(1), help="nodes to use (default: every node of the cluster)")
    parser.add_argument(
        "--gpus-per-node", type=int_between(1), help="processes per node (default: the GPUs of a node; 1 on CPU)"
    )
    parser.add_argument(
        "--launcher",
        choices=("horovodrun", "torchrun"),
        help="default: torchrun for --backend ddp and --model-parallel, else horovodrun",
    )
    parser.add_argument(
        "--model-parallel",
        action="store_true",
        help="PyTorch only: run training.model_parallel (FSDP2, pipeline, tensor parallel; --tp/--pp/--dp-shard "
        "among the job's flags) under torchrun",
    )
    parser.add_argument("--run-id", type=arg_type(check_run_id), help="default: <UTC time>-<framework>-<random>")
    parser.add_argument(
        "--requeue", action="store_true", help="if a node fails, Slurm requeues the job and it resumes from its "
        "newest checkpoint (in the run directory)"
    )  # fmt: skip
    parser.add_argument(
        "--local-copy",
        action="store_true",
        help="copy --data-dir to each node's local disk first, and train from there",
    )
    parser.add_argument("--time-limit", type=int_between(1), metavar="MINUTES", help="Slurm ends the job after this")
    parser.add_argument("--entrypoint", type=non_empty, help="job module or .py path instead of training.<framework>")
    parser.add_argument("--image", type=non_empty, help="docker runtime: image to run instead of the framework's")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", default=None, help="stream the output (default on a terminal)")
    mode.add_argument("--detach", action="store_true", help="print the job id and return")
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="-- then the job's own flags")
    parser.set_defaults(handler=run)


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    job_args = list(args.job_args)
    if job_args and job_args[0] == "--":
        job_args = job_args[1:]
    return LaunchOptions(
        framework=args.framework,
        job_args=job_args,
        nodes=args.nodes,
        processes_per_node=args.gpus_per_node,
        launcher=args.launcher,
        model_parallel=args.model_parallel,
        entrypoint=args.entrypoint,
        image=args.image,
        run_id=args.run_id,
        requeue=args.requeue,
        time_limit_minutes=args.time_limit,
        local_copy=args.local_copy,
    )


def run(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    follow_output = not args.detach and (args.follow or sys.stdout.isatty())
    with SSH(desc) as ssh:
        submitted = submit(desc, options_from_args(args), ssh)
        announce(submitted)
        if not follow_output:
            print(submitted.job_id, flush=True)  # alone on stdout: `job=$(python -m scripts launch --detach ...)`
            return 0
        slurm = Slurm(desc, ssh)
        job = Run(submitted.run_id, submitted.job_id, submitted.run_dir)
        echo = show_line if debugging(args) else without_launcher_tracebacks(show_line)
        try:
            return follow(desc, ssh, slurm, job, echo=echo)
        except KeyboardInterrupt:
            return ask_cancel_or_detach(slurm, job)


def show_line(line: str) -> None:
    print(line, flush=True)


def announce(submitted: Submission) -> None:
    spec = submitted.spec
    console.print(
        f"submitted job {submitted.job_id} (run {submitted.run_id}): {spec.world_size} processes with "
        f"{spec.launcher} on {spec.nodes} nodes; run directory {submitted.run_dir}"
    )
