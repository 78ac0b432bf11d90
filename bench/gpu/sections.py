"""The sections of ``python -m bench.gpu`` that set our training jobs beside plain-PyTorch loops.

Each figure runs two processes on the same device, the baseline first: our job exactly as
docs/performance.md tells a user to run it (``torchrun``, one process, default flags but for the
size, the timing warmup and, where a figure is taken both ways, ``--compile``), and the loop of
:mod:`bench.gpu.baselines` doing the same work on the same terms: the same precision, compile
mode, optimizer, timed steps and host reads of the loss (``--log-every`` on both sides). Each reads
the other's result only through its metrics JSON, and the wall time of each process (start-up and
compilation included) is kept beside its rate. ``--smoke`` sizes run in seconds, on the CPU too.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu.report import INDUCTOR_CACHES, GiB, Row, Scale
from bench.harness import proc
from bench.harness.steps import Shape

TIMEOUT_S = 420  # one process, compilation included (the budget's end may stop it sooner)
THREADS = 8  # CPU threads per process: the GPU does the work, the host only queues it
LOG_EVERY = 10  # the jobs' default --log-every: both sides read the loss on the host every 10 steps
SMOKE_LOG_EVERY = 2  # a smoke run's few steps still read the loss inside the timed window


@dataclass(frozen=True)
class GPTCase:
    model: str
    seq_len: int
    batch_size: int
    steps: int
    warmup: int


# 10 warmup steps: compilation, cuDNN autotuning, the allocator; then 40 steps timed.
RESNET = Shape(model="resnet50", image_size=224, batch=256, steps=50, warmup=10)
RESNET_SMOKE = Shape(model="resnet_tiny", image_size=32, batch=8, steps=6, warmup=2)
GPTS = (GPTCase("gpt-125m", 1024, 16, 40, 10), GPTCase("gpt-1.3b", 2048, 4, 30, 5))
GPTS_SMOKE = (GPTCase("gpt-tiny", 64, 4, 6, 2),)


def log_every(scale: Scale) -> int:
    return SMOKE_LOG_EVERY if scale.smoke else LOG_EVERY


def resnet_modes(scale: Scale) -> tuple[bool, ...]:
    """Eager and compiled at full size; a smoke run takes the one its device would take by default
    (compiled with CUDA, eager on the CPU, where compiling takes longer than the run)."""
    return (scale.cuda,) if scale.smoke else (False, True)


def torchrun(module: str, args: list[str]) -> list[str]:
    """One local process of ``module`` under torchrun (the module form: no script on PATH needed)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", module, *args]


def compile_flag(compiled: bool) -> str:
    return "--compile" if compiled else "--no-compile"


def baseline(loop: str, args: list[str], compiled: bool, every: int, cuda: bool) -> list[str]:
    """``bench.gpu.baselines loop`` on our side's terms: compiled or not, the loss read every ``every`` steps."""
    device = [] if cuda else ["--device", "cpu"]
    tail = [compile_flag(compiled), "--log-every", str(every), *device]
    return [sys.executable, "-m", "bench.gpu.baselines", loop, *args, *tail]


def our_resnet(shape: Shape, compiled: bool, every: int) -> list[str]:
    args = ["--backend", "ddp", "--data", "synthetic", *shape.args(), "--precision", "amp", compile_flag(compiled)]
    return torchrun("training.pytorch", [*args, "--log-every", str(every)])


def baseline_resnet(shape: Shape, compiled: bool, every: int, cuda: bool = True) -> list[str]:
    return baseline("resnet", shape.args(), compiled, every, cuda)


def gpt_args(case: GPTCase) -> list[str]:
    return [
        "--model", case.model, "--seq-len", str(case.seq_len), "--batch-size", str(case.batch_size),
        "--steps", str(case.steps), "--timing-warmup-steps", str(case.warmup),
    ]  # fmt: skip


def our_gpt(case: GPTCase, every: int) -> list[str]:
    """Compiled or not by the job's default (with CUDA, on), which the baseline follows."""
    return torchrun("training.model_parallel", ["--precision", "bf16", *gpt_args(case), "--log-every", str(every)])


def baseline_gpt(case: GPTCase, every: int, cuda: bool = True) -> list[str]:
    return baseline("gpt", gpt_args(case), cuda, every, cuda)


def timing_terms(steps: int, warmup: int, every: int) -> str:
    return f"loss read on the host every {every} steps; steps {warmup + 1}-{steps} timed"


def measure(cmd: list[str], metrics: Path, scale: Scale) -> tuple[dict[str, Any], float]:
    """Run ``cmd --metrics-json metrics``: (its metrics, its wall seconds)."""
    started = time.monotonic()
    env = proc.thread_env(THREADS, INDUCTOR_CACHES)
    proc.run([*cmd, "--metrics-json", str(metrics)], env, timeout=scale.timeout(TIMEOUT_S))
    wall = time.monotonic() - started
    if not metrics.is_file():
        raise proc.BenchError(f"{shlex.join(cmd)} wrote no metrics to {metrics}")
    return json.loads(metrics.read_text()), wall


def measure_pair(
    ours_cmd: list[str], base_cmd: list[str], work: Path, stem: str, scale: Scale
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The baseline, then ours: (our metrics, the baseline's, the Row fields both share)."""
    base, base_wall = measure(base_cmd, work / f"{stem}-baseline.json", scale)
    ours, ours_wall = measure(ours_cmd, work / f"{stem}-ours.json", scale)
    shared = {
        "ours_wall_s": ours_wall,
        "baseline_wall_s": base_wall,
        "command": shlex.join(ours_cmd),
        "baseline_command": shlex.join(base_cmd),
    }
    return ours, base, shared


def _gib(value: float | None) -> float | None:
    return None if value is None else value / GiB


def resnet_rows(work: Path, scale: Scale) -> Iterator[Row]:
    """Our ResNet-50 job (DDP backend, bf16 autocast) eager and compiled, each beside torchvision's recipe."""
    shape, every = RESNET_SMOKE if scale.smoke else RESNET, log_every(scale)
    for compiled in resnet_modes(scale):
        mode = "compiled" if compiled else "eager"
        cmds = our_resnet(shape, compiled, every), baseline_resnet(shape, compiled, every, scale.cuda)
        ours, base, shared = measure_pair(*cmds, work, f"resnet-{mode}", scale)
        terms = (
            f"bf16 autocast; {mode}{' (whole model, default mode)' if compiled else ''}; SGD momentum 0.9, "
            f"weight decay 1e-4 (foreach on CUDA); channels-last; {timing_terms(shape.steps, shape.warmup, every)}"
        )
        yield Row(
            "resnet50",
            f"{shape.model} {shape.image_size} px, batch {shape.batch}, bf16, {mode}",
            "img/s",
            ours["images_per_sec"],
            base["images_per_sec"],
            f"{base['model']}, {base['input']} input, no wrapper (as ours at world size 1)",
            terms,
            baseline_peak_gib=_gib(base.get("peak_memory_bytes")),
            **shared,
        )


def transformer_rows(work: Path, scale: Scale) -> Iterator[Row]:
    """Our model-parallel job at its defaults (one GPU, bf16) beside a bare compiled loop of the same model."""
    every = log_every(scale)
    for case in GPTS_SMOKE if scale.smoke else GPTS:
        cmds = our_gpt(case, every), baseline_gpt(case, every, scale.cuda)
        ours, base, shared = measure_pair(*cmds, work, case.model, scale)
        if ours["compiled"] != scale.cuda:  # the baseline compiles where ours compiles by default
            raise proc.BenchError(f"ours ran with compiled={ours['compiled']}, the baseline with {scale.cuda}")
        compiled = (
            "compiled (ours per block, the baseline whole; the loss fullgraph on both; default mode)"
            if ours["compiled"]
            else "eager"
        )
        terms = (
            f"bf16 autocast; {compiled}; AdamW betas 0.9/0.95, weight decay 0.1, fused on CUDA; "
            f"{timing_terms(case.steps, case.warmup, every)}; "
            f"activation checkpointing: ours {ours['activation_checkpointing']}, the baseline none"
        )
        yield Row(
            "transformer",
            f"{case.model}, seq {case.seq_len}, batch {case.batch_size}, bf16",
            "tok/s",
            ours["tokens_per_sec"],
            base["tokens_per_sec"],
            "bare loop: same model, same loss function",
            terms,
            ours_mfu=ours["mfu"],
            baseline_mfu=base["mfu"],
            ours_peak_gib=_gib(ours["peak_memory_bytes_per_rank"][0]),
            baseline_peak_gib=_gib(base["peak_memory_bytes"]),
            **shared,
        )
