"""`launch`: submit a training run to Slurm over SSH (through the jump host), then follow it or detach.

  python -m dtrain launch --framework pytorch --nodes 2 -- --data synthetic --steps 100
  python -m dtrain launch --workdir examples/ddp --gpus 1 -- python train.py --epochs 2   # your own code

The steps, each a module: submit (dtrain/jobs/submit.py: checks, run directory, job.sh, sbatch), follow
(dtrain/jobs/follow.py: the log until the job ends, and its exit), results (uploaded by the job itself on
the cluster, dtrain/remote/job/upload_results.py). Following is the default on a terminal; Ctrl-C then
asks whether to cancel the job or detach from it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from dtrain.cli.allocation_flags import add_allocation_arguments
from dtrain.cli_entry import add_cluster_option, arg_type, debugging, non_empty, positive_number
from dtrain.cluster.description import ClusterDescription, load
from dtrain.cluster.limits import budget_warning, held_at_submission, read_standings
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH
from dtrain.errors import OperatorError
from dtrain.jobs.allocation import cost_line
from dtrain.jobs.batch_script import render_job_script
from dtrain.jobs.follow import ask_cancel_or_detach, follow
from dtrain.jobs.launch_request import JobFlags, LaunchRequest
from dtrain.jobs.run_ids import check_run_id
from dtrain.jobs.runs import Run
from dtrain.jobs.submit import Plan, Submission, build_spec, node_hour_price, submit
from dtrain.jobs.task_file import env_name, is_task_file, load_task, parse_env, with_task
from dtrain.jobs.time_warning import parse_lead
from dtrain.jobs.tracking import OFF, check_experiment, check_tracking_uri
from dtrain.jobs.workdir import MAX_WORKDIR_MB
from dtrain.ui import make_console
from infra.contract import FRAMEWORKS

console = make_console()
DEFAULT_WORKDIR_FRAMEWORK = "pytorch"  # the image a --workdir command runs in when --framework names none

EPILOG = """\
Everything after `--` goes to the job (python -m training.<framework> --help, or with --model-parallel
python -m training.model_parallel --help). Horovod jobs run with horovodrun on a hostfile made from the
allocation; `--backend ddp` and `--model-parallel` (PyTorch) run torchrun under srun, one per node.
With --follow (the default on a terminal) the exit status is the job's own.

Your own code: --workdir DIR sends DIR (its .gitignore honoured) to the run directory, and everything
after `--` is the command, run there as written on every rank under torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or, with --launcher horovodrun, under horovodrun. Whatever it
writes to $OUTPUT_DIR reaches the results container with the run's logs; what it saves under
$CHECKPOINT_DIR (on the shared file system) is copied to the results container while it runs, each
file once complete (write .NAME.tmp, then rename it), and --resume-from RUN fetches it back into a new
run's $CHECKPOINT_DIR. Nothing is added to its arguments. A command that starts a launcher itself
(torchrun, accelerate launch, deepspeed) is refused there: --mode per-node runs it once per node, with
DTRAIN_NODE_RANK, DTRAIN_NUM_NODES, DTRAIN_NODE_LIST, DTRAIN_PROCESSES_PER_NODE, MASTER_ADDR, MASTER_PORT.

A task file (TASK.yaml: workdir, setup, run, envs, secrets, mode, resources; docs/operator.md) holds all
of it; flags given with it win over its keys. --env KEY=VALUE and --secret NAME (read from this
environment, never written down) reach the command and setup. A SkyPilot task file runs as written where
the cluster can do what it asks (num_nodes, resources.accelerators checked against the nodes' GPUs, ...),
once per node with SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, ...; a key it cannot honour is refused, named.

A job asks for 1 node and its GPUs one by one (it shares the node, seeing only its own GPUs) unless it
asks for every GPU of a node or --exclusive; its time limit is --time, else the cluster's default.
The allocation and its estimated hourly cost are shown before submission; --dry-run stops there and
prints the batch script.

examples:
  HF_TOKEN=... python -m dtrain launch examples/torchrun/task.yaml      # a task file: your torchrun per node
  python -m dtrain launch --workdir examples/ddp --gpus 1 -- python train.py --epochs 2
  python -m dtrain launch --workdir examples/horovod --launcher horovodrun --nodes 2 -- python train.py
  python -m dtrain launch --workdir examples/fsdp --nodes 2 --gpus-per-node 8 --time 4:00:00 -- \\
      python train.py --steps 1000
  python -m dtrain launch --dry-run --framework pytorch --gpus 2 -- --data synthetic --steps 10
  python -m dtrain launch --framework pytorch -- --data synthetic --steps 100
  python -m dtrain launch --framework pytorch --nodes 2 --requeue -- --backend ddp --data imagenet \\
      --data-dir /shared/data/imagenet --epochs 90
  python -m dtrain launch --framework keras --detach -- --data synthetic --epochs 1
  python -m dtrain launch --framework pytorch --spot -- --data synthetic --steps 5000 --checkpoint-every 100
  python -m dtrain launch --framework pytorch --resume-from RUN -- --data synthetic --steps 10000   # a new cluster
  python -m dtrain launch --framework pytorch --nodes 2 --gpus-per-node 8 --model-parallel -- \\
      --model gpt-1.3b --pp 2 --dp-shard -1 --precision bf16 --steps 200
"""


def configure(commands: argparse._SubParsersAction) -> None:
    """Add `launch` and its arguments, in the order --help lists them."""
    parser = commands.add_parser(
        "launch",
        help="submit a training job to Slurm and follow its output",
        description="Submit a training job (data- or model-parallel, or your own code) with sbatch (through the "
        "jump host) and stream every rank's output, prefixed [rank|host], until it ends. The run's logs, metrics, "
        "trained model (model/), "
        "TensorBoard events, summary.png and run.json (node-hours, estimated cost) reach the results container "
        "from the cluster, whether or not you stay attached.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_option(parser)
    _add_code_arguments(parser)
    add_allocation_arguments(parser)
    _add_launcher_arguments(parser)
    _add_run_arguments(parser)
    _add_job_source_arguments(parser)
    _add_tracking_arguments(parser)
    _add_follow_arguments(parser)
    _add_task_arguments(parser)
    parser.add_argument(
        "job_args", nargs=argparse.REMAINDER, help="TASK.yaml (then more flags), or -- then the job's own flags"
    )
    parser.set_defaults(handler=run, launch_parser=parser)


def _add_code_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs: one of our training jobs (--framework), or your own code (--workdir)."""
    parser.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        help="our training job to run (training.<framework>); with --workdir, whose image runs the command "
        "(default with --workdir: pytorch)",
    )
    parser.add_argument(
        "--workdir",
        type=non_empty,
        metavar="DIR",
        help="your own code: DIR goes to the run directory (.gitignore honoured) and the command after -- runs "
        "there on every rank, as written",
    )
    parser.add_argument(
        "--workdir-max-mb",
        type=positive_number,
        default=MAX_WORKDIR_MB,
        metavar="MB",
        help="refuse a --workdir larger than this after its excludes (default: %(default)s)",
    )


def _add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """How the ranks are started: horovodrun or torchrun, data or model parallel."""
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


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's id, and how it survives node failures, Spot evictions and its time limit."""
    parser.add_argument("--run-id", type=arg_type(check_run_id), help="default: <UTC time>-<framework>-<random>")
    parser.add_argument(
        "--requeue", action="store_true", help="if a node fails, Slurm requeues the job and it resumes from its "
        "newest checkpoint (in the run directory)"
    )  # fmt: skip
    parser.add_argument(
        "--no-gate",
        dest="gate",
        action="store_false",
        help="start a multi-node job without measuring its nodes first (default: a few seconds' all-reduce "
        "across them; a slow node is drained and the job requeued without it)",
    )
    spot = parser.add_mutually_exclusive_group()
    spot.add_argument(
        "--spot",
        action="store_true",
        help="run on the Spot partition: an eviction makes the job save a checkpoint and Slurm requeue it; "
        "it resumes on the next nodes (implies --requeue)",
    )
    spot.add_argument(
        "--spot-fallback",
        action="store_true",
        help="like --spot, but the job may also run on demand: Slurm starts it on Spot nodes where it can, "
        "on demand where Spot capacity is refused or busy (--partition=spot,gpu)",
    )
    parser.add_argument(
        "--resume-from",
        type=arg_type(check_run_id),
        metavar="RUN",
        help="start from the newest checkpoint RUN kept in the results container (it outlives the cluster: "
        "resume on a new one); the job's flags must fit it (same model)",
    )
    parser.add_argument(
        "--warn-before",
        type=arg_type(parse_lead),
        metavar="LEAD",
        help="SIGUSR1 this long before the time limit (90s, 5m, 1h; 0: none): our jobs save a checkpoint and "
        "end, your code may catch it (default 5m, at most half the time limit)",
    )


def _add_job_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the job's data, program and image come from, where not the defaults."""
    parser.add_argument(
        "--local-copy",
        action="store_true",
        help="copy --data-dir to each node's local disk first, and train from there",
    )
    parser.add_argument(
        "--entrypoint",
        type=non_empty,
        help="job module or .py path (on the nodes or in the image) instead of training.<framework>; its "
        "arguments are only those after --",
    )
    parser.add_argument(
        "--image",
        type=non_empty,
        help="docker runtime: image to run instead of the framework's (public, or in the cluster's registry; "
        "see docs/operator.md for what it must contain)",
    )


def _add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's MLflow server and experiment (dtrain/jobs/tracking.py)."""
    parser.add_argument(
        "--tracking-uri",
        type=arg_type(check_tracking_uri),
        metavar="URI",
        help="MLflow server for this run's parameters, curves and model (default: the cluster's, on its head "
        f"node; {OFF!r}: none); its token, if it needs one, is MLFLOW_TRACKING_TOKEN in the job's environment",
    )
    parser.add_argument(
        "--experiment",
        type=arg_type(check_experiment),
        help="MLflow experiment of the run (default: the cluster's name)",
    )


def _add_follow_arguments(parser: argparse.ArgumentParser) -> None:
    """What this command does once the job is ready: print it (--dry-run), follow it, or detach."""
    parser.add_argument(
        "--dry-run", action="store_true", help="print the allocation and job.sh, and submit nothing (exit 0)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", default=None, help="stream the output (default on a terminal)")
    mode.add_argument("--detach", action="store_true", help="print the job id and return")


def _add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that mirror a task file's keys (envs, secrets, mode)."""
    parser.add_argument(
        "--env", dest="envs", action="append", type=arg_type(parse_env), metavar="KEY=VALUE",
        help="an environment variable for your command and setup (repeatable; adds to a task file's envs)",
    )  # fmt: skip
    parser.add_argument(
        "--secret", dest="secrets", action="append", type=arg_type(env_name), metavar="NAME",
        help="pass the variable NAME from this environment to your command and setup, never written to argv, "
        "job.json or job.sh, masked (***) in the logs (repeatable; adds to a task file's secrets)",
    )  # fmt: skip
    parser.add_argument(
        "--mode", choices=("per-rank", "per-node"),
        help="per-rank (default): your command runs on every rank under our launcher; per-node: once per node, "
        "as your own launcher (torchrun, accelerate launch, deepspeed), with DTRAIN_NODE_RANK, MASTER_ADDR, ...",
    )  # fmt: skip


def read_request(args: argparse.Namespace) -> tuple[argparse.Namespace, LaunchRequest]:
    """The command line (with `launch TASK.yaml [flags] [-- command]`, the flags after the file too) and the
    frozen request made from it and the task file: the file's keys where no flag was given."""
    path = args.job_args[0] if args.job_args and is_task_file(args.job_args[0]) else None
    if path is not None:
        # a new namespace: argparse keeps a value already in it (a flag before the file) unless given again
        before = argparse.Namespace(**{**vars(args), "job_args": []})
        args = args.launch_parser.parse_args(args.job_args[1:], namespace=before)
    request = _request_from_flags(args)
    if path is not None:
        request = with_task(request, load_task(path), path)
    if not args.framework and not request.workdir:
        raise OperatorError("launch needs --framework (our training jobs) or --workdir (your own code)")
    if not request.workdir:  # our job's flags that decide something here, read once (the user's command has none)
        request = replace(request, job_flags=JobFlags.read(request.job_args))
    return args, request


def _request_from_flags(args: argparse.Namespace) -> LaunchRequest:
    job_args = list(args.job_args)
    if job_args[:1] == ["--"]:
        job_args = job_args[1:]
    return LaunchRequest(
        framework=args.framework or DEFAULT_WORKDIR_FRAMEWORK,
        job_args=tuple(job_args),
        nodes=args.nodes,
        processes_per_node=args.gpus_per_node,
        gpus=args.gpus,
        exclusive=args.exclusive,
        workdir=args.workdir,
        workdir_max_mb=args.workdir_max_mb,
        launcher=args.launcher,
        model_parallel=args.model_parallel,
        entrypoint=args.entrypoint,
        image=args.image,
        run_id=args.run_id,
        requeue=args.requeue,
        gate=args.gate,
        time_limit=args.time_limit,
        local_copy=args.local_copy,
        spot=args.spot,
        spot_fallback=args.spot_fallback,
        resume_from=args.resume_from,
        mode=args.mode,
        envs=dict(args.envs or {}),
        secrets=tuple(dict.fromkeys(args.secrets or [])),
        tracking_uri=args.tracking_uri,
        experiment=args.experiment,
        warn_before=args.warn_before,
    )


def check_framework_is_used(request: LaunchRequest, desc: ClusterDescription) -> None:
    """With --workdir, --framework picks the image (docker runtime, without --image) and the default
    launcher (per rank, without --launcher). Where it picks neither, it is refused rather than ignored."""
    docker = desc.runtime.kind == "docker"
    per_node = request.mode == "per-node"
    if (docker and not request.image) or (not per_node and not request.launcher):
        return
    image = f"the command runs in --image {request.image}" if docker else f"cluster {desc.name} runs jobs on its hosts"
    launcher = "it is its own launcher (--mode per-node)" if per_node else f"--launcher {request.launcher} starts it"
    raise OperatorError(f"--framework {request.framework} does nothing with --workdir here: {image}, and {launcher}")


def run(args: argparse.Namespace) -> int:
    args, request = read_request(args)  # first: flags after a task file (--cluster too) are read there
    desc = load(args.cluster)
    if request.workdir and args.framework:
        check_framework_is_used(request, desc)
    plan = build_spec(desc, request)
    show_request(desc, plan)
    if args.dry_run:
        print(render_job_script(plan.spec), end="", flush=True)  # alone on stdout: `launch --dry-run ... >job.sh`
        console.print("dry run: nothing submitted")
        return 0
    follow_output = not args.detach and (args.follow or sys.stdout.isatty())
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)
        warning = budget_warning(read_standings(slurm).get(desc.ssh_user))
        if warning:
            console.print(warning, style="yellow", markup=False, soft_wrap=True)
        submitted = submit(desc, request, ssh, plan)
        announce(submitted)
        if not follow_output:  # following says it as the job waits
            held = held_at_submission(slurm, submitted.job_id)
            if held:
                console.print(f"job {submitted.job_id}: {held}", style="yellow", markup=False, soft_wrap=True)
            print(submitted.job_id, flush=True)  # alone on stdout: `job=$(python -m dtrain launch --detach ...)`
            return 0
        job = Run(submitted.run_id, submitted.job_id, submitted.run_dir)
        try:
            return follow(desc, ssh, slurm, job, echo=show_line, debug=debugging(args))
        except KeyboardInterrupt:
            return ask_cancel_or_detach(slurm, job)


def show_request(desc: ClusterDescription, plan: Plan) -> None:
    """What the job will hold, for how long, and what an hour of it costs: before anything is submitted."""
    price, source = node_hour_price(desc)
    console.print(f"allocation: {plan.allocation.describe(desc)} on partition {plan.spec.partition}")
    if plan.workdir:
        console.print(
            f"workdir: {plan.workdir.path} ({plan.workdir.files} files, {plan.workdir.size_bytes / 2**20:,.1f} MiB "
            f"after .gitignore) -> {plan.spec.workdir}"
        )
    console.print(cost_line(plan.allocation, desc, price, source))


def show_line(line: str) -> None:
    print(line, flush=True)


def announce(submitted: Submission) -> None:
    spec = submitted.spec
    how = (
        "your command once per node" if spec.mode == "per-node" else f"{spec.world_size} processes with {spec.launcher}"
    )
    console.print(
        f"submitted job {submitted.job_id} (run {submitted.run_id}): {how} on {spec.nodes} nodes; "
        f"run directory {submitted.run_dir}"
    )
