"""The whole operator workflow on the embedded local cluster, in one command (`make demo`).

  python -m scripts.demo [--nodes 2] [--steps 6] [--keep]

up a 2-node local cluster -> generate a small synthetic ImageNet-layout JPEG dataset -> stage it to
blob storage (Azurite) -> pull it onto the shared file system with the read-only SAS -> launch a
2-node Horovod PyTorch ResNet job over SSH on that data -> upload the run to the results container
-> print a summary table (nodes, images/s, final loss, where the results are) -> tear the cluster
down, always, even when a step fails (unless --keep).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from pathlib import Path

from rich.table import Table

from scripts import blobs, local_cluster, stage
from scripts.cli import CLIParser, arg_type, check_directory, int_between, non_empty, run_cli
from scripts.cluster import DEFAULT_LOCAL_STATE, ClusterDescription
from scripts.errors import ExitCode, OperatorError
from scripts.launch import DEFAULT_RUNS_DIR, LaunchOptions, RunResult, launch
from scripts.ui import make_console

console = make_console()
DATASET = "synthetic-imagenet"


@dataclass
class DemoResult:
    exit_code: int
    nodes: list[str] = field(default_factory=list)
    run: RunResult | None = None
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


def run_demo(
    *,
    nodes: int = 2,
    steps: int = 6,
    batch_size: int = 8,
    image_size: int = 64,
    model: str = "resnet50",
    classes: int = 4,
    images_per_class: int = 32,
    state_dir: str | Path = DEFAULT_LOCAL_STATE,
    runs_dir: str | Path = DEFAULT_RUNS_DIR,
    name: str = local_cluster.DEFAULT_NAME,
    subnet: str | IPv4Network = local_cluster.DEFAULT_SUBNET,
    mode: str = "auto",
    keep: bool = False,
    entrypoint: str | None = None,
) -> DemoResult:
    """Run the demo; the cluster is always torn down at the end (unless keep)."""
    result = DemoResult(exit_code=1)
    state_dir = Path(state_dir)
    started = time.time()

    def phase(label: str, since: float) -> float:
        now = time.time()
        result.timings[label] = round(now - since, 1)
        return now

    if local_cluster.load_state(state_dir.resolve()) is not None:
        console.print(f"[yellow]a local cluster from an earlier run is recorded in {state_dir}: removing it[/yellow]")
        local_cluster.down(state_dir)
    try:
        t = time.time()
        console.rule(f"1/5 local cluster: {nodes} nodes")
        desc = local_cluster.up(nodes=nodes, state_dir=state_dir, name=name, subnet=subnet, mode=mode)  # type: ignore[arg-type]
        t = phase("cluster up", t)

        console.rule("2/5 synthetic ImageNet-layout dataset")
        with tempfile.TemporaryDirectory(prefix="hvd-demo-data-") as tmp:
            counts = stage.generate_synthetic_imagenet(
                tmp, classes=classes, train_per_class=images_per_class, val_per_class=2,
                image_size=image_size,
            )  # fmt: skip
            console.print(f"{counts['train']} train + {counts['val']} val JPEGs, {classes} classes")
            t = phase("dataset", t)

            console.rule("3/5 stage: upload to blob storage, pull onto the NFS share")
            up = stage.upload(desc.data, desc.staging_credential, tmp, DATASET, workers=8)
            stage.print_upload_summary(up)
            pulled = stage.pull(desc, DATASET, expected_files=up.source_files, expected_objects=up.objects)
            stage.print_pull_summary(pulled)
            t = phase("stage", t)

        console.rule(f"4/5 launch: Horovod PyTorch {model} on {nodes} nodes over SSH")
        opts = LaunchOptions(
            framework="pytorch",
            job_args=job_flags(desc, steps, batch_size, image_size, model),
            nodes=nodes,
            runs_dir=Path(runs_dir),
            entrypoint=entrypoint,
            job_timeout=600,
        )
        run = launch(desc, opts)
        result.run = run
        result.nodes = run.nodes
        t = phase("job", t)
        if run.results_url:
            client = blobs.container_client(desc.results)
            result.results_blobs = sum(1 for _ in client.list_blobs(name_starts_with=f"{run.run_id}/"))
        result.exit_code = run.exit_code
        if run.exit_code != 0:
            result.error = run.message or f"the job exited with status {run.exit_code}"
        elif not run.metrics:
            result.error = "the job wrote no metrics JSON"
            result.exit_code = ExitCode.FAILED
    except OperatorError as exc:
        result.error = str(exc)
        result.exit_code = exc.exit_code
    except KeyboardInterrupt:
        result.error = "interrupted"
        result.exit_code = ExitCode.INTERRUPTED
    finally:
        if keep:
            console.print(
                f"--keep: the cluster stays up; `python -m scripts.local_cluster --state-dir {state_dir} down`"
            )
        else:
            console.rule("5/5 tear down")
            t = time.time()
            local_cluster.down(state_dir)
            phase("down", t)
        result.timings["total"] = round(time.time() - started, 1)
    return result


def summary_table(result: DemoResult, keep: bool = False) -> Table:
    table = Table(title="demo summary")
    table.add_column("")
    table.add_column("")
    run = result.run
    metrics = (run.metrics if run else None) or {}

    def num(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    table.add_row("status", "[green]ok[/green]" if result.exit_code == 0 else f"[red]failed: {result.error}[/red]")
    table.add_row("nodes", ", ".join(result.nodes) or "-")
    table.add_row("processes (world size)", str(metrics.get("world_size", run.world_size if run else "-")))
    table.add_row("images/s (all ranks)", num("images_per_sec", ".1f"))
    table.add_row("final loss", num("final_loss", ".4f"))
    if run:
        table.add_row("run id", run.run_id)
        table.add_row("logs and metrics", str(run.run_dir))
        where = run.results_url or "-"
        if run.results_url and not keep:
            where += f"  ({result.results_blobs} blobs; Azurite was removed with the cluster)"
        table.add_row("results container", where)
    table.add_row("time", ", ".join(f"{k} {v:g}s" for k, v in result.timings.items()))
    return table


def build_parser() -> CLIParser:
    parser = CLIParser(prog="python -m scripts.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int_between(1, local_cluster.MAX_NODES), default=2)
    parser.add_argument("--steps", type=int_between(1), default=6, help="training steps (default 6)")
    parser.add_argument("--batch-size", type=int_between(1), default=8, help="per process (default 8)")
    parser.add_argument("--image-size", type=int_between(8, 4096), default=64)
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "resnet_tiny", "simple_cnn"))
    parser.add_argument("--state-dir", type=non_empty, default=str(DEFAULT_LOCAL_STATE))
    parser.add_argument("--runs-dir", type=non_empty, default=str(DEFAULT_RUNS_DIR))
    parser.add_argument("--subnet", type=arg_type(local_cluster.parse_subnet), default=local_cluster.DEFAULT_SUBNET)
    parser.add_argument("--name", type=arg_type(local_cluster.check_name), default=local_cluster.DEFAULT_NAME)
    parser.add_argument("--mode", choices=("auto", "netns", "localhost"), default="auto")
    parser.add_argument("--keep", action="store_true", help="leave the cluster up at the end")
    return parser


def _run(args: argparse.Namespace) -> int:
    check_directory(args.runs_dir, "--runs-dir")  # before a cluster is made for nothing
    result = run_demo(
        nodes=args.nodes,
        steps=args.steps,
        batch_size=args.batch_size,
        image_size=args.image_size,
        model=args.model,
        state_dir=args.state_dir,
        runs_dir=args.runs_dir,
        name=args.name,
        subnet=args.subnet,
        mode=args.mode,
        keep=args.keep,
    )
    make_console(stderr=False).print(summary_table(result, args.keep))
    if result.exit_code != 0:
        raise OperatorError(f"demo failed: {result.error}", result.exit_code)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
