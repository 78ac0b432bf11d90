"""``python -m bench``: every benchmark of issues 5 and 10 in one run, each beside its baseline.

Run it with the training environment (``.venv-train/bin/python -m bench``); the staging figure
runs in the operator environment (``--ops-python``). Writes results.json, results.md and
results.png into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench.cpu import allreduce, comm, frameworks, local_sgd, overhead, parallel, pipeline, tracking
from bench.harness import jpegs, proc, report, steps
from bench.harness.plot import write_png
from bench.harness.results import BELOW, Figure, markdown_table, median, to_json
from training.data.transcode import transcode_tree

SECTIONS = ("allreduce", "overhead", "comm", "pipeline", "staging", "frameworks", "parallel", "local_sgd", "tracking")
console = Console()


@dataclass(frozen=True)
class Plan:
    """Sizes of one run. The full plan fits in 15 minutes on 2 loaded cores; quick is for tests."""

    shape: steps.Shape
    rounds: int
    allreduce_elements: int
    jpegs: int
    pipeline_size: int
    pipeline_batch: int
    pipeline_workers: int
    frameworks_rounds: int
    pipeline_rounds: int  # the loader's rounds: at least 5 for the figure, its noise is the largest


FULL = Plan(steps.Shape(), 3, allreduce.RESNET50_PARAMS, 512, 224, 32, 2, 1, 5)
QUICK = Plan(
    steps.Shape(model="resnet_tiny", image_size=32, batch=8, steps=4, warmup=1, num_classes=10),
    1,
    1_000_000,
    48,
    64,
    8,
    2,
    1,
    1,
)
TRANSCODED_SHORT_SIDE = 160  # the copy of the pipeline_transcoded figure (stage --short-side 160)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.splitlines()[0],
        epilog="Sections: allreduce (gloo vs loopback bound, fp16 compression), overhead (job vs bare loop), "
        "comm (2 ranks with the allreduce vs without, Horovod and DDP), pipeline (our loader vs torchvision defaults), "
        "staging (stage upload vs a sequential loop, Azurite), frameworks (TF and Keras vs PyTorch), "
        "parallel (FSDP memory per rank vs one process, pipeline bubble vs theory, FSDP vs DDP step time), "
        "local_sgd (time to every-step's loss with local-sgd and hierarchical, 2 local-cluster nodes, full speed "
        "and 100 Mbit/s; also local_sgd.json and local_sgd.png), "
        "tracking (the job logging every step to a real mlflow server vs tracking off). "
        "See docs/performance.md for the method.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke test, not numbers)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per figure (default: 3, quick: 1)")
    parser.add_argument("--threads", type=int, default=1, help="threads per process for single-process figures")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results",
        help="where results.* go (default bench/results/)",
    )
    parser.add_argument(
        "--ops-python",
        type=Path,
        default=proc.REPO_ROOT / ".venv" / "bin" / "python",
        help="operator-environment interpreter for the staging figure",
    )
    parser.add_argument("--work-dir", type=Path, help="generated JPEGs (default: a temporary directory)")
    return parser.parse_args(argv)


class Runner:
    """Runs sections in order, records load and failures, keeps the figures."""

    def __init__(self, progress: Progress, task: int) -> None:
        self.figures: list[Figure] = []
        self.load: dict[str, tuple[float, float]] = {}
        self.failed: list[str] = []
        self.progress, self.task = progress, task

    def section(self, name: str, title: str, body: Callable[[], list[Figure]]) -> None:
        self.progress.update(self.task, description=name)
        before = proc.load_average()[0]
        try:
            figures = body()
        except Exception as exc:  # one broken section must not hide the others
            console.print(f"[red]{name} failed:[/red] {exc}")
            self.failed.append(name)
            figures = [Figure.skipped(name, title, f"failed: {str(exc).splitlines()[0][:120]}")]
        self.load[name] = (before, proc.load_average()[0])
        for f in figures:
            style = "red" if f.status == BELOW else "green"
            ratio = "-" if f.ratio is None else f"{f.ratio:.3f}"
            console.print(f"  {f.key}: ratio [{style}]{ratio}[/{style}] {f.status}")
        self.figures += figures
        self.progress.advance(self.task)


def run(args: argparse.Namespace, work: Path) -> tuple[list[Figure], dict, list[str]]:
    plan = QUICK if args.quick else FULL
    rounds = args.rounds or plan.rounds
    wanted = [s for s in SECTIONS if not args.only or s in args.only]
    started = time.monotonic()
    bus: dict[str, float] = {}

    def do_allreduce() -> list[Figure]:
        figures = allreduce.figures(allreduce.run(rounds + 2, plan.allreduce_elements))
        bus["fp32"] = figures[0].ours or 0.0
        return figures

    def do_pipeline() -> list[Figure]:
        jpegs.write_imagenet_tree(work, plan.jpegs)
        copy = work.with_name(f"{work.name}-short-side-{TRANSCODED_SHORT_SIDE}")
        transcode_tree(work, copy, TRANSCODED_SHORT_SIDE)  # once, as `stage --short-side` does
        shape = (plan.pipeline_size, plan.pipeline_batch, plan.pipeline_workers, max(rounds, plan.pipeline_rounds))
        return [pipeline.measure(work, *shape), pipeline.measure(work, *shape, ours_root=copy)]

    def do_staging() -> list[Figure]:
        jpegs.write_imagenet_tree(work, plan.jpegs)
        out = work / "staging.json"
        cmd = [str(args.ops_python), "-m", "bench.cpu.staging", "--source", str(work / "train")]
        proc.run([*cmd, "--rounds", str(rounds), "--json", str(out)], proc.thread_env(1))
        return staging_figures(json.loads(out.read_text()))

    bodies: dict[str, tuple[str, Callable[[], list[Figure]]]] = {
        "allreduce": ("Allreduce over gloo", do_allreduce),
        "overhead": ("Framework overhead", lambda: [overhead.measure(plan.shape, rounds, args.threads)]),
        "comm": (
            "Communication efficiency",
            lambda: [comm.measure(plan.shape, rounds, launcher, bus.get("fp32")) for launcher in comm.LAUNCHERS],
        ),
        "pipeline": ("Input pipeline", do_pipeline),
        "staging": ("Staging upload", do_staging),
        "frameworks": (
            "TensorFlow and Keras vs PyTorch",
            lambda: frameworks.measure(plan.shape, plan.frameworks_rounds, args.threads),
        ),
        "parallel": ("Model parallelism", lambda: parallel.measure(rounds, args.quick)),
        "local_sgd": ("Local SGD over a slow link", lambda: local_sgd.measure(args.ops_python, args.out, args.quick)),
        "tracking": ("MLflow tracking overhead", lambda: [tracking.measure(plan.shape, rounds, args.threads)]),
    }
    columns = (TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        runner = Runner(progress, progress.add_task("", total=len(wanted)))
        for name in wanted:
            runner.section(name, *bodies[name])
    context = {
        "command": shlex.join(["python", "-m", "bench", *(sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "versions": versions(),
        "shape": plan.shape.describe(),
        "plan": plan.__dict__ | {"shape": plan.shape.__dict__, "rounds": rounds, "threads": args.threads},
        "load": runner.load,
        "elapsed_s": time.monotonic() - started,
        "failed_sections": runner.failed,
    }
    return runner.figures, context, runner.failed


def staging_figures(raw: dict) -> list[Figure]:
    """Per-file upload as requests/s and client CPU per request (a ratio against an emulator on the
    same 2 cores is bounded by the emulator: see docs/performance.md), and the sharded upload in MB/s."""
    s, mb, files = raw["seconds"], raw["bytes"] / 1e6, raw["files"]
    figures = []
    for key, ours, unit, amount, goal, label in (
        ("staging_requests", "ours", "requests/s", files, None, "stage upload (8 workers)"),
        ("staging_sharded", "ours_sharded", "MB/s", mb, 5.0, "stage upload --shard-size-mb 16"),
    ):
        figure = Figure.from_rounds(
            key,
            f"Staging {files} files ({mb:.0f} MB) to Azurite: {label}",
            unit,
            [amount / t for t in s[ours]],
            [amount / t for t in s["sequential"]],
            goal=goal,
            ours_label=label,
            baseline_label="sequential loop",
        )
        figure.note = f"cores busy, Azurite/client: ours {_busy(s, ours)}, loop {_busy(s, 'sequential')}"
        figures.append(figure)
    per_request = f"{_per_request_ms(s, 'ours', files)} ms, loop {_per_request_ms(s, 'sequential', files)} ms"
    figures[0].note = f"client CPU per request: ours {per_request}; {figures[0].note}"
    return figures


def _per_request_ms(s: dict, key: str, files: int) -> str:
    return f"{1000 * median(s[f'{key}_client_cpu']) / files:.2f}"


def _busy(s: dict, key: str) -> str:
    """Cores each side kept busy, CPU seconds over wall seconds: the profile of an upload."""
    return "/".join(f"{median(s[f'{key}_{side}_cpu']) / median(s[key]):.2f}" for side in ("server", "client"))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    code = "import torch, horovod, tensorflow as tf; print(torch.__version__, horovod.__version__, tf.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=proc.thread_env(1))
    names = ("torch", "horovod", "tensorflow")
    return dict(zip(names, out.stdout.split(), strict=False))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-jpegs-") as tmp:
        figures, context, failed = run(args, args.work_dir or Path(tmp))
    extra = {"scaling_model": {"anchors": report.model_rows(), "nd_h100_v5_projection": report.projection_rows()}}
    (args.out / "results.json").write_text(to_json(figures, context, extra) + "\n")
    (args.out / "results.md").write_text(report.markdown(figures, context))
    write_png(figures, args.out / "results.png")
    print(markdown_table(figures))
    console.print(f"wrote {args.out}/results.json, results.md, results.png in {context['elapsed_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
