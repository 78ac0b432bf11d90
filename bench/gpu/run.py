"""``python -m bench.gpu`` (``make bench-gpu``): our GPU jobs beside plain PyTorch on the same GPU.

Needs one CUDA device; without one it exits 3 with one ``error:`` line before running anything,
unless ``--smoke``. Runs the sections of :data:`SECTIONS` in turn (each figure is a pair of child
processes) and rewrites ``results-gpu.json`` and ``results-gpu.md`` in ``--out`` after each one, so
that a run stopped later keeps what it measured; they record the card, its driver, the CPUs and
the software versions. It stops within 6 minutes on one H100, compilation included:
``--budget-s`` (330 s) skips a section whose estimated cost no longer fits, and says so in both
files, and no measured process runs past it. ``--smoke`` runs every section at tiny sizes (under
90 s on a GPU; on a CPU-only machine too, eager, as CI does). Works without Horovod (the PyTorch
job runs its DDP backend) and on torch 2.11 as on the pinned 2.13.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu import decode_e2e as gpu_decode_e2e
from bench.gpu import sections as gpu_sections
from bench.gpu.report import Row, Scale, Section, failed_row, markdown, skipped_row, write
from training.config.args import Parser, seconds_arg

# Adding a section is one line: Section(name, title, function(scratch directory, scale) -> rows,
# estimated seconds at full size on one H100, estimated seconds of its smoke run). The estimates are
# the wall times of the H100 runs of 2026-11-27 (docs/performance.md): resnet50 41 s eager and about
# 135 s compiled with both compilations cold; decode about 230 s with its compilations cold, less
# once the resnet50 section has filled Inductor's cache; transformer: gpt-125m's pair and gpt-1.3b's
# bare loop took about 160 s together, and gpt-1.3b's job did not finish in the 29 s left to it.
SECTIONS: list[Section] = [
    Section("resnet50", "ResNet-50, data parallel (DDP backend)", gpu_sections.resnet_rows, 180, 30),
    Section("transformer", "GPT, model-parallel job on one GPU", gpu_sections.transformer_rows, 330, 25),
    Section("decode", "JPEG input: --decode cpu, gpu, auto vs synthetic", gpu_decode_e2e.section_rows, 180, 35),
]
BUDGET_S = 330  # 6 minutes on one H100, less start-up and a margin
EXIT_NO_CUDA = 3  # environment not ready (the project's exit statuses)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="python -m bench.gpu",
        description=__doc__.splitlines()[0],
        epilog="Example: python -m bench.gpu --only transformer. Sections: "
        + ", ".join(f"{s.name} ({s.title}; about {s.cost_s:.0f} s)" for s in SECTIONS)
        + ". Method and figures: docs/performance.md (GPU figures).",
    )
    names = [section.name for section in SECTIONS]
    parser.add_argument("--only", action="append", choices=names, help="run only this section (repeatable)")
    parser.add_argument(
        "--out",
        type=Path,
        help="where results-gpu.* go (default: bench/results/; with --smoke, bench-gpu-smoke/ in TMPDIR)",
    )
    parser.add_argument(
        "--budget-s",
        type=seconds_arg,
        default=BUDGET_S,
        help="seconds the run may take: a section whose estimate no longer fits is skipped, "
        "and a process still running at the end is stopped (default: %(default)s)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="every section at tiny sizes: checks the harness, on a CPU too"
    )
    args = parser.parse_args(argv)
    if args.out is None:  # a smoke run's rows are no figures: they never replace the real ones
        args.out = (
            Path(tempfile.gettempdir()) / "bench-gpu-smoke" if args.smoke else Path(__file__).parents[1] / "results"
        )
    try:  # before any section runs: a result that cannot be written is a run wasted
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot make it: {exc.strerror}")
    if not os.access(args.out, os.W_OK | os.X_OK):
        parser.error(f"--out {args.out}: not writable")
    return args


def cuda_missing() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    import torch

    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False (torch {torch.__version__})"
    return None


def versions() -> dict[str, str]:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("torchvision", "numpy", "horovod"):
        try:
            found[name] = importlib.import_module(name).__version__
        except Exception:  # absent, or present but broken (torchvision beside a CPU torch)
            found[name] = "absent"
    return found


def driver_version() -> str:
    """The NVIDIA driver's version from nvidia-smi; else the CUDA driver API version torch sees; else "unknown"."""
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        found = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.split()
        if found:
            return found[0]
    except (OSError, subprocess.SubprocessError):
        pass
    import torch

    if torch.cuda.is_available():
        api = torch._C._cuda_getDriverVersion()  # e.g. 13000; no public API names the driver itself
        return f"CUDA driver API {api // 1000}.{api % 1000 // 10} (no nvidia-smi)"
    return "unknown"


@dataclass
class Outcome:
    """What the sections have left so far: their rows, and which failed, were skipped, are still to run."""

    rows: list[Row] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)


def run_sections(
    sections: Sequence[Section], work: Path, scale: Scale, started: float, save: Callable[[Outcome], None]
) -> Outcome:
    """Each section in turn, ``save``d after each row and as it ends. A section that fails keeps the
    rows it measured and leaves a row saying so, and the others still run; one whose estimated cost
    no longer fits the budget left is skipped, with a row saying so."""
    outcome = Outcome(pending=[section.name for section in sections])
    save(outcome)  # at once: files left by an earlier run must not pass for this one's
    for section in sections:
        cost, elapsed, left = section.cost(scale.smoke), time.monotonic() - started, scale.deadline - time.monotonic()
        outcome.pending.remove(section.name)
        if cost > left:
            outcome.skipped.append(section.name)
            outcome.rows.append(skipped_row(section, cost, elapsed, left))
            print(f"bench.gpu: {section.name} skipped: about {cost:.0f} s, {left:.0f} s left", flush=True)
        else:
            print(f"bench.gpu: {section.name} ({section.title}; about {cost:.0f} s)", flush=True)
            try:
                for row in section.rows(work, scale):
                    outcome.rows.append(row)
                    save(outcome)
            except Exception as exc:
                outcome.failed.append(section.name)
                outcome.rows.append(failed_row(section, str(exc)))
                print(f"bench.gpu: {section.name} failed: {exc}", file=sys.stderr, flush=True)
        save(outcome)
    return outcome


def machine(device: str) -> dict[str, Any]:
    """What the figures are read beside: the card, its driver, the host's CPUs, the software versions."""
    return {"device": device, "driver": driver_version(), "cpu_count": os.cpu_count(), "versions": versions()}


def context(
    command: str, args: argparse.Namespace, facts: dict[str, Any], started: float, outcome: Outcome
) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **facts,
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "elapsed_s": time.monotonic() - started,
        "failed_sections": outcome.failed,
        "skipped_sections": outcome.skipped,
        "pending_sections": outcome.pending,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    missing = cuda_missing()
    if missing is not None and not args.smoke:
        print(f"error: python -m bench.gpu needs a CUDA device: {missing}", file=sys.stderr)
        return EXIT_NO_CUDA
    import torch

    started = time.monotonic()
    cuda = missing is None
    if not cuda:
        print("bench.gpu: no CUDA device: a smoke run on the CPU (eager, --decode cpu only)", flush=True)
    command = shlex.join(["python", "-m", "bench.gpu", *(sys.argv[1:] if argv is None else argv)])
    facts = machine(torch.cuda.get_device_name(0) if cuda else "cpu")
    scale = Scale(smoke=args.smoke, cuda=cuda, deadline=started + args.budget_s)
    wanted = [section for section in SECTIONS if not args.only or section.name in args.only]

    def save(outcome: Outcome) -> None:
        write(outcome.rows, context(command, args, facts, started, outcome), args.out)

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        outcome = run_sections(wanted, Path(tmp), scale, started, save)
    info = context(command, args, facts, started, outcome)
    json_path, md_path = write(outcome.rows, info, args.out)
    print(markdown(outcome.rows, info))
    print(f"wrote {json_path} and {md_path} in {info['elapsed_s']:.0f} s")
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
