"""The whole operator workflow on the embedded local cluster, in one command (`make demo`).

  python -m dtrain demo [--nodes 2] [--steps 6] [--keep]

up a 2-node local cluster (Slurm, sshd, Azurite, MLflow) -> generate a small synthetic ImageNet-layout
JPEG dataset -> stage it to blob storage (Azurite) -> pull it onto the shared file system with the
read-only SAS -> wait for the cluster's MLflow to answer -> submit a 2-node Horovod PyTorch ResNet job
to Slurm over SSH and follow it, tracked in MLflow -> download what the job uploaded to the results
container (its trained model, TensorBoard events, summary.png, run.json with node-hours and cost) to
runs/<run-id>/ -> print a summary table -> tear the cluster
down, always, even when a step fails (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from pathlib import Path

from rich.table import Table
from rich.text import Text

from dtrain import idle_cost, pricing
from dtrain.cli import stage
from dtrain.cli_entry import arg_type, int_between, non_empty
from dtrain.cluster.description import DEFAULT_LOCAL_STATE, ClusterDescription
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH
from dtrain.errors import ExitCode, OperatorError
from dtrain.jobs.follow import follow
from dtrain.jobs.launch_request import JobFlags, LaunchRequest
from dtrain.jobs.results import DEFAULT_DEST, Downloaded, download_run
from dtrain.jobs.runs import Run
from dtrain.jobs.submit import Submission, submit
from dtrain.local import cluster as local_cluster
from dtrain.local import mlflow_server as local_mlflow
from dtrain.ui import make_console

console = make_console()
DATASET = "synthetic-imagenet"
MLFLOW_WAIT_S = 90  # its first start on a busy 2-core machine took about 50 s


@dataclass
class DemoResult:
    exit_code: int
    submission: Submission | None = None
    metrics: dict | None = None
    record: dict | None = None  # run.json: node-hours and estimated cost
    results_blobs: int = 0
    downloaded: Path | None = None  # the local copy of the run's results
    results_url: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def job_flags(desc: ClusterDescription, steps: int, batch_size: int, image_size: int, model: str) -> list[str]:
    return [
        "--data", "imagenet",
        "--data-dir", f"{desc.data_path}/{DATASET}",
        "--image-size", str(image_size),
        "--model", model,
        "--batch-size", str(batch_size),
        "--steps", str(steps),
        "--warmup-epochs", "0",
        "--timing-warmup-steps", "2",
        "--log-every", "1",
        "--seed", "42",
    ]  # fmt: skip


@dataclass
class DemoSettings:
    nodes: int = 2
    steps: int = 6
    batch_size: int = 8
    image_size: int = 64
    model: str = "resnet50"
    classes: int = 4
    images_per_class: int = 32
    state_dir: str | Path = DEFAULT_LOCAL_STATE
    name: str = local_cluster.DEFAULT_NAME
    subnet: str | IPv4Network = local_cluster.DEFAULT_SUBNET
    keep: bool = False
    entrypoint: str | None = None
    download_dir: str | Path = DEFAULT_DEST  # the run's results are copied to <download_dir>/<run-id>/


def run_demo(settings: DemoSettings | None = None) -> DemoResult:
    """Run the demo; the cluster is always torn down at the end (unless settings.keep)."""
    settings = settings or DemoSettings()
    result = DemoResult(exit_code=1)
    state_dir = Path(settings.state_dir)
    started = time.time()
    if local_cluster.load_state(state_dir.resolve()) is not None:
        console.print(f"[yellow]a local cluster from an earlier run is recorded in {state_dir}: removing it[/yellow]")
        local_cluster.down(state_dir)
    try:
        _steps(settings, result)
    except OperatorError as exc:
        result.error, result.exit_code = str(exc), exc.exit_code
    except KeyboardInterrupt:
        result.error, result.exit_code = "interrupted", ExitCode.INTERRUPTED
    finally:
        if settings.keep:
            console.print(f"--keep: the cluster stays up; `dtrain local down --state-dir {state_dir}`")
        else:
            console.rule("6/6 tear down")
            t = time.time()
            local_cluster.down(state_dir)
            result.timings["down"] = round(time.time() - t, 1)
        result.timings["total"] = round(time.time() - started, 1)
    return result


def _steps(settings: DemoSettings, result: DemoResult) -> None:
    clock = [time.time()]

    def phase(label: str) -> None:
        now = time.time()
        result.timings[label] = round(now - clock[0], 1)
        clock[0] = now

    console.rule(f"1/6 local cluster: {settings.nodes} nodes, with Slurm")
    desc = local_cluster.up(
        nodes=settings.nodes, state_dir=settings.state_dir, name=settings.name, subnet=settings.subnet
    )
    phase("cluster up")
    _stage(desc, settings)
    phase("stage")
    _wait_for_tracking(desc)
    console.rule(f"4/6 launch: sbatch a Horovod PyTorch {settings.model} job on {settings.nodes} nodes, follow it")
    with SSH(desc) as ssh:
        job_args = job_flags(desc, settings.steps, settings.batch_size, settings.image_size, settings.model)
        request = LaunchRequest(
            framework="pytorch",
            job_args=tuple(job_args),
            job_flags=JobFlags.read(job_args),
            nodes=settings.nodes,
            entrypoint=settings.entrypoint,
        )
        result.submission = submitted = submit(desc, request, ssh)
        console.print(f"submitted job {submitted.job_id} (run {submitted.run_id})")
        run = Run(submitted.run_id, submitted.job_id, submitted.run_dir)
        result.exit_code = follow(desc, ssh, Slurm(desc, ssh), run)
    phase("job")
    console.rule("5/6 results: what the job uploaded to the results container, downloaded")
    _read_results(desc, result, settings.download_dir)
    if result.exit_code != 0:
        result.error = f"the job exited with status {result.exit_code}"
    elif not result.metrics:
        result.error, result.exit_code = "the job uploaded no metrics.json", ExitCode.FAILED


def _wait_for_tracking(desc: ClusterDescription) -> None:
    """The cluster's MLflow comes up beside Slurm and may still be starting (its first start makes its
    database): the demo's job is there to be seen, so it waits, within a bound, rather than run untracked."""
    if desc.tracking_uri is None or local_mlflow.wait_until_answers(desc.tracking_uri, 0):
        return
    console.print(f"waiting for MLflow at {desc.tracking_uri} to answer (at most {MLFLOW_WAIT_S} s)")
    if not local_mlflow.wait_until_answers(desc.tracking_uri, MLFLOW_WAIT_S):
        console.print(f"[yellow]MLflow did not answer within {MLFLOW_WAIT_S} s: the job runs untracked[/yellow]")


def _stage(desc: ClusterDescription, settings: DemoSettings) -> None:
    console.rule("2/6 synthetic ImageNet-layout dataset")
    with tempfile.TemporaryDirectory(prefix="hvd-demo-data-") as tmp:
        counts = stage.generate_synthetic_imagenet(
            tmp, classes=settings.classes, train_per_class=settings.images_per_class, val_per_class=2,
            image_size=settings.image_size,
        )  # fmt: skip
        console.print(f"{counts['train']} train + {counts['val']} val JPEGs, {settings.classes} classes")
        console.rule("3/6 stage: upload to blob storage, pull onto the NFS share")
        up = stage.upload(desc.data, desc.staging_credential, tmp, DATASET, workers=8)
        stage.print_upload_summary(up)
        pulled = stage.pull(desc, DATASET, expected_files=up.source_files, expected_objects=up.objects)
        stage.print_pull_summary(pulled)


def _read_results(desc: ClusterDescription, result: DemoResult, download_dir: str | Path) -> None:
    """Download the run (Azurite goes with the cluster; the copy stays) and read its metrics and record."""
    assert result.submission is not None
    run_id = result.submission.run_id
    result.results_url = f"{desc.results.url}/{run_id}/"
    got: Downloaded = download_run(desc, run_id, download_dir)
    result.results_blobs, result.downloaded = len(got.files), got.directory
    console.print(f"{len(got.files)} blobs under {result.results_url}, copied to {got.directory}")
    result.metrics = _json_file(got.directory / "metrics.json")
    result.record = _json_file(got.directory / "run.json")


def _json_file(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def summary_table(result: DemoResult, keep: bool = False) -> Table:
    table = Table(title="demo summary")
    table.add_column("")
    table.add_column("")
    submitted, metrics = result.submission, result.metrics or {}

    def num(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    table.add_row("status", Text("ok", "green") if result.exit_code == 0 else Text(f"failed: {result.error}", "red"))
    if submitted:
        table.add_row("Slurm job", f"{submitted.job_id} ({submitted.spec.launcher}, {submitted.spec.nodes} nodes)")
        table.add_row("run id", submitted.run_id)
    table.add_row("processes (world size)", str(metrics.get("world_size", "-")))
    table.add_row("images/s (all ranks)", num("images_per_sec", ".1f"))
    table.add_row("final loss", num("final_loss", ".4f"))
    if submitted:
        where = f"{result.results_blobs} blobs" + ("" if keep else " (Azurite was removed with the cluster)")
        table.add_row("results container", where)
    if result.downloaded:
        table.add_row("trained model", _present(result, "model", f"{result.results_url}model/"))
        table.add_row("curves", _present(result, "summary.png", "loss and images/s over steps"))
        table.add_row("TensorBoard", _present(result, "tensorboard", "tensorboard --logdir {}"))
    if result.record:
        table.add_row("cost", cost_line(result.record))
    table.add_row("time", ", ".join(f"{k} {v:g}s" for k, v in result.timings.items()))
    return table


def _present(result: DemoResult, name: str, note: str) -> str:
    """The local copy of one of the run's outputs, and a note on it; or what is missing."""
    assert result.downloaded is not None
    path = result.downloaded / name
    if not path.exists():
        return f"[red]missing: the job wrote no {name}[/red]"
    return f"{path} ({note.format(path)})"


def azure_reference_price() -> tuple[str, str, float] | None:
    """The GPU size, region and node-hour price of the repository's example stack (Pulumi.dev.yaml)."""
    try:
        cfg = pricing.read_stack_config(pricing.DEFAULT_STACK_FILE)
        price = pricing.node_hour_price(cfg.gpu_sku, cfg.location)
    except OperatorError:
        return None
    return None if price is None else (cfg.gpu_sku, cfg.location, float(price.usd_per_hour))


def cost_line(record: dict) -> str:
    """Node-hours and the estimated cost; for the local cluster, what the same job costs on Azure: its own
    charge, and what starting the example stack's nodes cold for it costs (boot, the idle tail until
    autostop, the head node, NFS and jumpbox meanwhile)."""
    hours = record.get("node_hours") or 0.0
    cost = record.get("estimated_cost_usd")
    line = f"{hours:.4f} node-hours, " + (f"${cost:.2f}" if cost is not None else "no price known")
    line += f" ({record.get('price_source')})"
    reference = azure_reference_price()
    if record.get("gpu_sku") is None and reference is not None:
        sku, region, price = reference
        line += f"; on Azure ({sku}, {region}, ${price:.2f}/node-hour): {_azure_cold_start(record)}"
    return line


def _azure_cold_start(record: dict) -> str:
    attempts = record.get("attempts") or [{}]
    nodes = int(attempts[-1].get("nodes") or 1)
    seconds = sum(a.get("seconds") or 0 for a in attempts)
    billed = record.get("billed_node_hours", record.get("node_hours")) or 0.0
    idle = idle_cost.for_stack_file(pricing.DEFAULT_STACK_FILE, nodes)
    cold = None if idle is None else idle_cost.cold_start(idle, billed, seconds)
    if idle is None or cold is None:
        return "no price for a cold start"
    return (
        f"${cold.job_usd:,.2f} for the job alone; ${cold.total:,.2f} with a cold start of its {nodes} "
        f"nodes (boot, about {idle_cost.COLD_START_MINUTES} min: ${cold.boot_usd:,.2f}; idle until autostop, "
        f"{idle.autostop_minutes} min: ${cold.tail_usd:,.2f}; head node, NFS, jumpbox and registry: "
        f"${cold.standing_usd:,.2f})"
    )


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="the whole workflow on a local cluster, then tear it down (make demo)",
        description=__doc__.split("\n\n")[0] + " (as root; about 2 minutes)",
        epilog="examples: python -m dtrain demo; python -m dtrain demo --nodes 3 --steps 10 --keep",
    )
    parser.add_argument("--nodes", type=int_between(1, local_cluster.MAX_NODES), default=2)
    parser.add_argument("--steps", type=int_between(1), default=6, help="training steps (default 6)")
    parser.add_argument("--batch-size", type=int_between(1), default=8, help="per process (default 8)")
    parser.add_argument("--image-size", type=int_between(8, 4096), default=64)
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "resnet_tiny", "simple_cnn"))
    parser.add_argument("--state-dir", type=non_empty, default=str(DEFAULT_LOCAL_STATE))
    parser.add_argument("--subnet", type=arg_type(local_cluster.parse_subnet), default=local_cluster.DEFAULT_SUBNET)
    parser.add_argument("--name", type=arg_type(local_cluster.check_name), default=local_cluster.DEFAULT_NAME)
    parser.add_argument("--keep", action="store_true", help="leave the cluster up at the end")
    parser.add_argument(
        "--download-dir", type=non_empty, default=DEFAULT_DEST, help="copy the run's results to DIR/<run-id> (runs)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    settings = DemoSettings(
        nodes=args.nodes, steps=args.steps, batch_size=args.batch_size, image_size=args.image_size,
        model=args.model, state_dir=args.state_dir, name=args.name, subnet=args.subnet, keep=args.keep,
        download_dir=args.download_dir,
    )  # fmt: skip
    result = run_demo(settings)
    make_console(stderr=False).print(summary_table(result, args.keep))
    if result.exit_code != 0:
        raise OperatorError(f"demo failed: {result.error}", result.exit_code)
    return 0
