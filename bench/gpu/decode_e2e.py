"""JPEG training end to end on one GPU: ``--decode cpu``, ``gpu`` and ``auto`` against synthetic data.

``python -m bench.gpu.decode_e2e [--images 512] [--epochs 20] [--json out.json]`` on a CUDA node
with torchvision (the PyTorch image); elsewhere it exits 3 with one ``error:`` line.

For each mode (eager, ``--compile``) the PyTorch job (DDP, one process under torchrun) trains the
same model on synthetic data, the baseline, then on generated 500x375 JPEGs with each decoder. Each
row gives the job's measured images/s, that rate as a ratio of the synthetic rate of the same mode,
and images per host CPU-second: the run's images over the CPU time every process on the host used
while it ran (``/proc/stat``, start-up included; the synthetic row shows that floor). Sized for
about three minutes on one H100, most of it start-up and compilation (an estimate from the rates in
docs/performance.md: not yet timed on a GPU). As a section of ``python -m bench.gpu``
(:func:`section_rows`) it runs the compiled mode only, or a smoke run's tiny plan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.gpu.report import INDUCTOR_CACHES, Row, Scale
from bench.harness import proc
from bench.harness.jpegs import write_imagenet_tree

MODES = {"eager": ["--no-compile"], "compiled": ["--compile"]}  # on CUDA the job compiles by default
DECODES = ("cpu", "gpu", "auto")


@dataclass(frozen=True)
class Plan:
    images: int = 512  # 2 batches an epoch: writing the files is a few seconds of the budget
    batch: int = 256
    epochs: int = 20
    warmup: int = 10  # steps left out of each rate: compilation and autotuning
    model: str = "resnet50"
    image_size: int = 224
    # ImageNet's, for every run, though the JPEGs have 4 classes: synthetic and JPEG runs then train
    # the same model, the very one bench.gpu's resnet50 section compiles (served from Inductor's cache)
    num_classes: int = 1000
    workers: int | None = None  # the job's default: the node's CPUs minus one, at most 8

    @property
    def steps(self) -> int:
        return self.images // self.batch * self.epochs


DEFAULT = Plan()
SMOKE = Plan(images=16, batch=8, epochs=2, warmup=1, model="resnet_tiny", image_size=32)
NO_BUDGET = Scale(smoke=False, cuda=True, deadline=math.inf)  # run alone: each job has proc's timeout
Run = Callable[[list[str]], tuple[dict[str, Any], float]]  # job arguments -> (metrics, host CPU seconds)


def job_args(plan: Plan, mode: str, data_dir: Path | None, decode: str | None) -> list[str]:
    """The PyTorch job's arguments for one row: synthetic data (``data_dir`` None) or the JPEGs."""
    common = [
        "--backend", "ddp", "--model", plan.model, "--image-size", str(plan.image_size),
        "--batch-size", str(plan.batch), "--num-classes", str(plan.num_classes), "--precision", "amp",
        "--timing-warmup-steps", str(plan.warmup), "--log-every", str(plan.steps), *MODES[mode],
    ]  # fmt: skip
    if data_dir is None:
        return [*common, "--data", "synthetic", "--steps", str(plan.steps)]
    workers = [] if plan.workers is None else ["--data-workers", str(plan.workers)]
    data = ["--data", "imagenet", "--data-dir", str(data_dir), "--epochs", str(plan.epochs)]
    return [*common, *data, "--decode", str(decode), *workers]


def host_cpu_seconds() -> float:
    """CPU time this host's processes have used since boot: every state of ``/proc/stat`` but idle,
    iowait and steal."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run_job(args: list[str], scale: Scale = NO_BUDGET) -> tuple[dict[str, Any], float]:
    before = host_cpu_seconds()
    timeout = scale.timeout(proc.TIMEOUT_S)
    metrics = proc.run_json("ddp", 1, "training.pytorch", args, threads=1, timeout=timeout, **INDUCTOR_CACHES)
    return metrics, host_cpu_seconds() - before


def row(plan: Plan, mode: str, source: str, metrics: dict[str, Any], cpu_s: float, synthetic: float) -> dict[str, Any]:
    rate = float(metrics["images_per_sec"])
    return {
        "mode": mode,
        "input": source,
        "decoder": metrics.get("decoder"),
        "images_per_sec": rate,
        "vs_synthetic": rate / synthetic,
        "host_cpu_s": cpu_s,
        "images_per_host_cpu_s": plan.steps * plan.batch / cpu_s,
    }


def rows(
    data_dir: Path,
    plan: Plan = DEFAULT,
    run: Run = run_job,
    modes: Sequence[str] = tuple(MODES),
    decodes: Sequence[str] = DECODES,
) -> list[dict]:
    """Every row, each mode's synthetic baseline first; ``data_dir`` gets the JPEGs if it has none."""
    write_imagenet_tree(data_dir, plan.images)
    table: list[dict] = []
    for mode in modes:
        metrics, cpu_s = run(job_args(plan, mode, None, None))
        synthetic = float(metrics["images_per_sec"])
        table.append(row(plan, mode, "synthetic", metrics, cpu_s, synthetic))
        for decode in decodes:
            metrics, cpu_s = run(job_args(plan, mode, data_dir, decode))
            table.append(row(plan, mode, f"jpeg --decode {decode}", metrics, cpu_s, synthetic))
    return table


def section_rows(work: Path, scale: Scale, run: Run | None = None) -> list[Row]:
    """The JPEG rows as a section of ``python -m bench.gpu``: each decoder's rate beside the synthetic
    rate of the same mode (the input path's ceiling), with what the host's CPUs paid for it.

    Compiled only (the goal: ``--decode auto`` at 0.95 of the synthetic rate with ``--compile``), the
    model and shape that the resnet50 section compiled, so each job's compiled code comes from
    Inductor's cache. A smoke run: :data:`SMOKE`, in the mode its device takes by default; on the
    CPU, eager and ``--decode cpu`` only (``gpu`` and ``auto`` need CUDA)."""
    plan = SMOKE if scale.smoke else DEFAULT
    mode = "compiled" if scale.cuda else "eager"
    decodes = DECODES if scale.cuda else ("cpu",)
    table = rows(work / "jpegs", plan, run or partial(run_job, scale=scale), [mode], decodes)
    terms = (
        f"the same job both sides: bf16 autocast; {mode}; loss read on the host at the end only; "
        f"steps {plan.warmup + 1}-{plan.steps} timed"
    )
    missing = "" if scale.cuda else "; --decode gpu and auto not run: they need CUDA"
    return [
        Row(
            "decode",
            f"{plan.model} on JPEGs, {r['input']}, {r['mode']}",
            "img/s",
            r["images_per_sec"],
            r["images_per_sec"] / r["vs_synthetic"],
            f"synthetic data, {r['mode']}",
            terms,
            note=f"decoder {r['decoder'] or '-'}; {r['images_per_host_cpu_s']:.0f} img per host CPU-s{missing}",
        )
        for r in table
        if r["input"] != "synthetic"
    ]


def format_table(table: list[dict]) -> str:
    lines = [f"{'mode':9} {'input':18} {'images/s':>9} {'vs synthetic':>12} {'img/host CPU-s':>14}  decoder"]
    for r in table:
        lines.append(
            f"{r['mode']:9} {r['input']:18} {r['images_per_sec']:9.0f} {r['vs_synthetic']:12.3f} "
            f"{r['images_per_host_cpu_s']:14.0f}  {r['decoder'] or '-'}"
        )
    return "\n".join(lines)


def unready() -> str | None:
    """Why this host cannot take the figures, or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False): run this on a GPU node"
    from training.data.gpu_decode import choose_decoder
    from training.errors import BadInput

    try:
        choose_decoder("gpu", torch.device("cuda"))
    except BadInput as exc:
        return str(exc)
    return None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu.decode_e2e",
        description=__doc__.splitlines()[0],
        epilog="example: python -m bench.gpu.decode_e2e --json gpu_decode.json",
    )
    defaults = DEFAULT
    parser.add_argument("--images", type=int, default=defaults.images, help="generated JPEGs (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=defaults.epochs, help="per JPEG run (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch, help="default: %(default)s")
    parser.add_argument("--data-workers", type=int, help="the job's --data-workers (default: the job's default)")
    parser.add_argument("--only", choices=tuple(MODES), help="one mode only (default: both)")
    parser.add_argument("--work-dir", type=Path, help="where the JPEGs go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.images < args.batch_size:
        parser.error("--images must be at least --batch-size")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    problem = unready()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 3
    plan = Plan(images=args.images, batch=args.batch_size, epochs=args.epochs, workers=args.data_workers)
    modes = [args.only] if args.only else list(MODES)
    with tempfile.TemporaryDirectory(prefix="gpu-decode-") as tmp:
        table = rows(args.work_dir or Path(tmp), plan, modes=modes)
    print(format_table(table))
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
