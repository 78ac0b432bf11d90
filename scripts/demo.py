"""The whole operator workflow on the embedded local cluster, in one command (`make demo`).

  python -m scripts demo [--nodes 2] [--steps 6] [--keep]

up a 2-node local cluster (Slurm, sshd, Azurite) -> generate a small synthetic ImageNet-layout JPEG
dataset -> stage it to blob storage (Azurite) -> pull it onto the shared file system with the
read-only SAS -> submit a 2-node Horovod PyTorch ResNet job to Slurm over SSH and follow it -> read
its metrics back from the results container, where the job uploaded its run -> print a summary
table -> tear the cluster down, always, even when a step fails (unless --keep).
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

from scripts import blobs, local_cluster, stage
from scripts.cli import arg_type, int_between, non_empty
from scripts.cluster import DEFAULT_LOCAL_STATE, ClusterDescription
from scripts.errors import ExitCode, OperatorError
from scripts.follow import follow
from scripts.runs import Run
from scripts.slurm import Slurm
from scripts.sshutil import SSH
from scripts.submit import LaunchOptions, Submission, submit
from scripts.ui import make_console

console = make_console()
DATASET = "synthetic-imagenet"


@dataclass
class DemoResult:
    exit_code: int
    submission: Submission | None = None
    metrics: dict | None = None
    results_blobs: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def job_flags(desc: ClusterDescription, steps: int, batch_size: int, image_size: int, model: str) -> list[str]:
    return [
        "--data", "imagenet",
        "--data-dir", f"{desc.data_path}/{DATASET}",
        "--image-size", str(image_size),
        "--model", model,
        "--batch-size", str(batch_size),
        "--epochs", "1",
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
            console.print(f"--keep: the cluster stays up; `python -m scripts local down --state-dir {state_dir}`")
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
    console.rule(f"4/6 launch: sbatch a Horovod PyTorch {settings.model} job on {settings.nodes} nodes, follow it")
    with SSH(desc) as ssh:
        opts = LaunchOptions(
            framework="pytorch",
            job_args=job_flags(desc, settings.steps, settings.batch_size, settings.image_size, settings.model),
            nodes=settings.nodes,
            entrypoint=settings.entrypoint,
        )
        result.submission = submitted = submit(desc, opts, ssh)
        console.print(f"submitted job {submitted.job_id} (run {submitted.run_id})")
        run = Run(submitted.run_id, submitted.job_id, submitted.run_dir)
        result.exit_code = follow(desc, ssh, Slurm(desc, ssh), run)
    phase("job")
    console.rule("5/6 results: what the job uploaded to the results container")
    _read_results(desc, result)
    if result.exit_code != 0:
        result.error = f"the job exited with status {result.exit_code}"
    elif not result.metrics:
        result.error, result.exit_code = "the job uploaded no metrics.json", ExitCode.FAILED


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


def _read_results(desc: ClusterDescription, result: DemoResult) -> None:
    assert result.submission is not None
    client = blobs.container_client(desc.results)
    names = [blob.name for blob in client.list_blobs(name_starts_with=f"{result.submission.run_id}/")]
    result.results_blobs = len(names)
    console.print(f"{len(names)} blobs under {desc.results.url}/{result.submission.run_id}/")
    metrics_blob = f"{result.submission.run_id}/metrics.json"
    if metrics_blob in names:
        result.metrics = json.loads(client.download_blob(metrics_blob).readall())


def summary_table(result: DemoResult, keep: bool = False) -> Table:
    table = Table(title="demo summary")
    table.add_column("")
    table.add_column("")
    submitted, metrics = result.submission, result.metrics or {}

    def num(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    table.add_row("status", "[green]ok[/green]" if result.exit_code == 0 else f"[red]failed: {result.error}[/red]")
    if submitted:
        table.add_row("Slurm job", f"{submitted.job_id} ({submitted.spec.launcher}, {submitted.spec.nodes} nodes)")
        table.add_row("run id", submitted.run_id)
    table.add_row("processes (world size)", str(metrics.get("world_size", "-")))
    table.add_row("images/s (all ranks)", num("images_per_sec", ".1f"))
    table.add_row("final loss", num("final_loss", ".4f"))
    if submitted:
        where = f"{result.results_blobs} blobs" + ("" if keep else " (Azurite was removed with the cluster)")
        table.add_row("results container", where)
    table.add_row("time", ", ".join(f"{k} {v:g}s" for k, v in result.timings.items()))
    return table


def configure(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="the whole workflow on a local cluster, then tear it down (make demo)",
        description=__doc__.split("\n\n")[0] + " (as root; about 2 minutes)",
        epilog="examples: python -m scripts demo; python -m scripts demo --nodes 3 --steps 10 --keep",
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
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    settings = DemoSettings(
        nodes=args.nodes, steps=args.steps, batch_size=args.batch_size, image_size=args.image_size,
        model=args.model, state_dir=args.state_dir, name=args.name, subnet=args.subnet, keep=args.keep,
    )  # fmt: skip
    result = run_demo(settings)
    make_console(stderr=False).print(summary_table(result, args.keep))
    if result.exit_code != 0:
        raise OperatorError(f"demo failed: {result.error}", result.exit_code)
    return 0
