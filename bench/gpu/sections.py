"""The sections of ``python -m bench.gpu`` that set our training jobs beside plain-PyTorch loops.

Each figure runs two processes on the same GPU, the baseline first: our job exactly as
docs/performance.md tells a user to run it (``torchrun``, one process, default flags but for the
size and the timing warmup), and the loop of :mod:`bench.gpu_baselines` doing the same work. Each
reads the other's result only through its metrics JSON, and the wall time of each process
(start-up and compilation included) is kept beside its rate.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu.report import GiB, Row
from bench.harness import proc
from bench.harness.steps import Shape

TIMEOUT_S = 420  # one process, compilation included: most of the whole run's 8-minute budget
THREADS = 8  # CPU threads per process: the GPU does the work, the host only queues it


@dataclass(frozen=True)
class GPTCase:
    model: str
    seq_len: int
    batch_size: int
    steps: int
    warmup: int


# 20 warmup steps: compilation, cuDNN autotuning, the allocator.
RESNET = Shape(model="resnet50", image_size=224, batch=256, steps=80, warmup=20)
GPTS = (GPTCase("gpt-125m", 1024, 16, 50, 10), GPTCase("gpt-1.3b", 2048, 4, 30, 5))


def torchrun(module: str, args: list[str]) -> list[str]:
    """One local process of ``module`` under torchrun (the module form: no script on PATH needed)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", module, *args]


def compile_flag(compiled: bool) -> str:
    return "--compile" if compiled else "--no-compile"


def our_resnet(shape: Shape, compiled: bool) -> list[str]:
    args = ["--backend", "ddp", "--data", "synthetic", *shape.args(), "--precision", "amp", compile_flag(compiled)]
    return torchrun("training.pytorch", args)


def baseline_resnet(shape: Shape, compiled: bool) -> list[str]:
    return [sys.executable, "-m", "bench.gpu.baselines", "resnet", *shape.args(), compile_flag(compiled)]


def our_gpt(case: GPTCase) -> list[str]:
    return torchrun(
        "training.model_parallel",
        [
            "--precision", "bf16", "--model", case.model, "--seq-len", str(case.seq_len),
            "--batch-size", str(case.batch_size), "--steps", str(case.steps),
            "--timing-warmup-steps", str(case.warmup),
        ],
    )  # fmt: skip


def baseline_gpt(case: GPTCase) -> list[str]:
    return [
        sys.executable, "-m", "bench.gpu.baselines", "gpt", "--model", case.model, "--seq-len", str(case.seq_len),
        "--batch-size", str(case.batch_size), "--steps", str(case.steps), "--timing-warmup-steps", str(case.warmup),
    ]  # fmt: skip


def measure(cmd: list[str], metrics: Path) -> tuple[dict[str, Any], float]:
    """Run ``cmd --metrics-json metrics``: (its metrics, its wall seconds)."""
    started = time.monotonic()
    proc.run([*cmd, "--metrics-json", str(metrics)], proc.thread_env(THREADS), timeout=TIMEOUT_S)
    wall = time.monotonic() - started
    if not metrics.is_file():
        raise proc.BenchError(f"{shlex.join(cmd)} wrote no metrics to {metrics}")
    return json.loads(metrics.read_text()), wall


def measure_pair(
    ours_cmd: list[str], base_cmd: list[str], work: Path, stem: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The baseline, then ours: (our metrics, the baseline's, the Row fields both share)."""
    base, base_wall = measure(base_cmd, work / f"{stem}-baseline.json")
    ours, ours_wall = measure(ours_cmd, work / f"{stem}-ours.json")
    shared = {
        "ours_wall_s": ours_wall,
        "baseline_wall_s": base_wall,
        "command": shlex.join(ours_cmd),
        "baseline_command": shlex.join(base_cmd),
    }
    return ours, base, shared


def _gib(value: float | None) -> float | None:
    return None if value is None else value / GiB


def resnet_rows(work: Path) -> list[Row]:
    """Our ResNet-50 job (DDP backend, bf16 autocast) eager and compiled, each beside torchvision's recipe."""
    rows = []
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        cmds = our_resnet(RESNET, compiled), baseline_resnet(RESNET, compiled)
        ours, base, shared = measure_pair(*cmds, work, f"resnet-{mode}")
        rows.append(
            Row(
                "resnet50",
                f"ResNet-50 {RESNET.image_size} px, batch {RESNET.batch}, bf16, {mode}",
                "img/s",
                ours["images_per_sec"],
                base["images_per_sec"],
                f"{base['model']}, channels-last, SGD, {mode}, no wrapper (as ours at world size 1)",
                baseline_peak_gib=_gib(base.get("peak_memory_bytes")),
                **shared,
            )
        )
    return rows


def transformer_rows(work: Path) -> list[Row]:
    """Our model-parallel job at its defaults (one GPU, bf16) beside a bare compiled loop of the same model."""
    rows = []
    for case in GPTS:
        ours, base, shared = measure_pair(our_gpt(case), baseline_gpt(case), work, case.model)
        rows.append(
            Row(
                "transformer",
                f"{case.model}, seq {case.seq_len}, batch {case.batch_size}, bf16",
                "tok/s",
                ours["tokens_per_sec"],
                base["tokens_per_sec"],
                "bare loop: same model, fused AdamW, bf16 autocast, torch.compile, no AC",
                ours_mfu=ours["mfu"],
                baseline_mfu=base["mfu"],
                ours_peak_gib=_gib(ours["peak_memory_bytes_per_rank"][0]),
                baseline_peak_gib=_gib(base["peak_memory_bytes"]),
                **shared,
                note=f"ours: activation checkpointing {ours['activation_checkpointing']}, compiled {ours['compiled']}",
            )
        )
    return rows
