"""``python -m bench.gpu`` (``make bench-gpu``): our GPU jobs beside plain PyTorch on the same GPU.

Needs one CUDA device; without one it exits 3 with one ``error:`` line before running anything.
Runs every section of :data:`SECTIONS` in one process tree (each figure is a pair of child
processes), then writes ``results-gpu.json`` and ``results-gpu.md`` into ``--out`` with the device
name and the software versions (budget: 8 minutes on one H100). Works without Horovod (the PyTorch
job runs its DDP backend) and on torch 2.11 as on the pinned 2.13.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu import decode_e2e as gpu_decode_e2e
from bench.gpu import sections as gpu_sections
from bench.gpu.report import Row, Section, failed_row, markdown, write

# Adding a section is one line: Section(name, title, function(scratch directory) -> list[Row]).
SECTIONS: list[Section] = [
    Section("resnet50", "ResNet-50, data parallel (DDP backend)", gpu_sections.resnet_rows),
    Section("transformer", "GPT, model-parallel job on one GPU", gpu_sections.transformer_rows),
    Section("decode", "JPEG input: --decode cpu, gpu and auto against synthetic data", gpu_decode_e2e.section_rows),
]
EXIT_NO_CUDA = 3  # environment not ready (the project's exit statuses)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__.splitlines()[0],
        epilog="Example: python -m bench.gpu --only transformer. Sections: "
        + ", ".join(f"{s.name} ({s.title})" for s in SECTIONS)
        + ". Method and figures: docs/performance.md (GPU figures).",
    )
    names = [section.name for section in SECTIONS]
    parser.add_argument("--only", action="append", choices=names, help="run only this section (repeatable)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parents[1] / "results",
        help="where results-gpu.* go (default: bench/results/)",
    )
    return parser.parse_args(argv)


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


def run_sections(sections: Sequence[Section], work: Path) -> tuple[list[Row], list[str]]:
    """Every section's rows; a section that fails leaves a row saying so, and the others still run."""
    rows: list[Row] = []
    failed: list[str] = []
    for section in sections:
        print(f"bench.gpu: {section.name} ({section.title})", flush=True)
        try:
            found = section.rows(work)
        except Exception as exc:
            failed.append(section.name)
            found = [failed_row(section, str(exc))]
            print(f"bench.gpu: {section.name} failed: {exc}", file=sys.stderr, flush=True)
        rows += found
    return rows, failed


def context(device: str, started: float, failed: list[str]) -> dict[str, Any]:
    return {
        "command": shlex.join(["python", "-m", "bench.gpu", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "versions": versions(),
        "elapsed_s": time.monotonic() - started,
        "failed_sections": failed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    missing = cuda_missing()
    if missing is not None:
        print(f"error: python -m bench.gpu needs a CUDA device: {missing}", file=sys.stderr)
        return EXIT_NO_CUDA
    import torch

    started = time.monotonic()
    wanted = [section for section in SECTIONS if not args.only or section.name in args.only]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        rows, failed = run_sections(wanted, Path(tmp))
    info = context(torch.cuda.get_device_name(0), started, failed)
    json_path, md_path = write(rows, info, args.out)
    print(markdown(rows, info))
    print(f"wrote {json_path} and {md_path} in {info['elapsed_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
