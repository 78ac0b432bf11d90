"""``python -m bench.gpu`` without a GPU: its refusal, its report, its commands and its baseline loops.

The figures themselves need a CUDA device (``make bench-gpu``); what is checked here is everything
around them, cheaply: the exit status and single error line on a CPU-only machine, the JSON and
Markdown written from given rows, a failing section reported beside the others, every command a
section runs accepted by the program it runs on the same terms as its pair, and the baseline
loops' arithmetic and host reads on a tiny CPU run. The whole run's smoke, its per-section writes
and its budget: tests/bench/test_gpu_run.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.gpu import baselines as gpu_baselines
from bench.gpu import run as gpu
from bench.gpu import sections as gpu_sections
from bench.gpu.report import Row, Scale, Section, write
from tests.training.jobs import REPO
from training import model_parallel
from training.config.args import log_interval
from training.config.settings import parse_settings as parse_data_parallel


def test_without_cuda_it_exits_3_with_one_error_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 3
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: python -m bench.gpu needs a CUDA device"), proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def fake_rows() -> list[Row]:
    return [
        Row(
            "resnet50", "ResNet-50 eager", "img/s", 3900.0, 3978.0, "torchvision", "eager; sync every 10",
            ours_wall_s=20.0,
        ),
        Row(
            "transformer", "gpt-1.3b", "tok/s", 50000.0, 49780.0, "bare loop", "compiled",
            ours_mfu=0.459, baseline_mfu=0.457, ours_peak_gib=33.0, baseline_peak_gib=37.0,
            command="torchrun -m training.model_parallel", baseline_command="python -m bench.gpu.baselines gpt",
        ),
    ]  # fmt: skip


def test_report_has_rows_ratios_device_and_versions(tmp_path: Path) -> None:
    context = {
        "command": "python -m bench.gpu",
        "date": "2026-11-25T00:00:00+00:00",
        "device": "NVIDIA H100 80GB HBM3",
        "driver": "580.95.05",
        "cpu_count": 16,
        "versions": {"torch": "2.11.0+cu130", "horovod": "absent"},
        "smoke": False,
        "budget_s": 330.0,
        "elapsed_s": 320.0,
        "failed_sections": [],
        "skipped_sections": [],
        "pending_sections": [],
    }
    json_path, md_path = write(fake_rows(), context, tmp_path)
    document = json.loads(json_path.read_text())
    assert document["context"]["device"] == "NVIDIA H100 80GB HBM3"
    assert [row["ratio"] for row in document["rows"]] == [pytest.approx(3900 / 3978), pytest.approx(50000 / 49780)]
    assert document["rows"][1]["ours_mfu"] == 0.459 and document["rows"][1]["baseline_peak_gib"] == 37.0
    assert document["rows"][0]["terms"] == "eager; sync every 10"
    text = md_path.read_text()
    assert "NVIDIA H100 80GB HBM3** (driver 580.95.05, 16 CPUs;" in text and "320 s of a 330 s budget" in text
    assert "torch 2.11.0+cu130, horovod absent" in text and "Partial" not in text
    assert "| gpt-1.3b | tok/s | 50,000 | 49,780 | 1.004 | compiled | 45.9% / 45.7% | 33.0 / 37.0 |" in text
    assert "| ResNet-50 eager | img/s | 3,900 | 3,978 | 0.980 | eager; sync every 10 | - / - | - / - | 20 / - |" in text
    assert not list(tmp_path.glob(".*"))  # the files were written beside and renamed


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    def broken(work: Path, scale: Scale) -> list[Row]:
        raise RuntimeError("CUDA out of memory\ntraceback...")

    sections = [Section("broken", "Broken", broken, 1, 1), Section("fine", "Fine", lambda *_: fake_rows()[:1], 1, 1)]
    started = time.monotonic()
    outcome = gpu.run_sections(sections, tmp_path, Scale(False, True, started + 60), started, lambda outcome: None)
    assert outcome.failed == ["broken"] and outcome.skipped == outcome.pending == []
    assert outcome.rows[0].note == "failed: CUDA out of memory" and outcome.rows[0].ratio is None
    assert outcome.rows[1].name == "ResNet-50 eager"


def job_args(cmd: list[str]) -> list[str]:
    """The job's own arguments in a ``torchrun ... -m module args`` command."""
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    return cmd[cmd.index("-m", 4) + 2 :]


@pytest.mark.parametrize("compiled", [False, True])
def test_resnet_commands_are_what_the_programs_accept_on_the_same_terms(compiled: bool) -> None:
    every = gpu_sections.LOG_EVERY
    ours = parse_data_parallel("pytorch", job_args(gpu_sections.our_resnet(gpu_sections.RESNET, compiled, every)))
    assert (ours.backend, ours.model, ours.batch_size, ours.precision) == ("ddp", "resnet50", 256, "amp")
    assert ours.compile is compiled and ours.image_size == 224
    base_cmd = gpu_sections.baseline_resnet(gpu_sections.RESNET, compiled, every)
    base = gpu_baselines.parse([*base_cmd[3:], "--metrics-json", "x"])
    assert (base.loop, base.model, base.batch_size, base.compile) == ("resnet", "resnet50", 256, compiled)
    assert base.image_size == 224 and base.num_classes == ours.num_classes == 1000 and base.device == "cuda"
    assert (base.steps, base.timing_warmup_steps) == (ours.steps, ours.timing_warmup_steps)
    assert base.log_every == ours.log_every == 10  # the job's default: a host read of the loss every 10 steps


@pytest.mark.parametrize("case", gpu_sections.GPTS, ids=lambda case: case.model)
def test_transformer_commands_are_the_defaults_at_the_issue_sizes(case: gpu_sections.GPTCase) -> None:
    ours = model_parallel.parse_settings(job_args(gpu_sections.our_gpt(case, gpu_sections.LOG_EVERY)))
    shape = (case.model, case.seq_len, case.batch_size)
    assert (ours.model, ours.seq_len, ours.batch_size, ours.precision) == (*shape, "bf16")
    assert ours.parallel.activation_checkpointing == "auto" and ours.compile is None  # the defaults a user gets
    # the jobs' default interval in a long run, passed explicitly: a 50-step run left to its default logs every 2
    assert ours.log_every == log_interval(None, 200) == 10
    base = gpu_baselines.parse([*gpu_sections.baseline_gpt(case, gpu_sections.LOG_EVERY)[3:], "--metrics-json", "x"])
    assert (base.model, base.seq_len, base.batch_size, base.compile) == (*shape, True)
    assert (base.steps, base.timing_warmup_steps, base.log_every) == (ours.steps, ours.timing_warmup_steps, 10)


def test_smoke_commands_run_on_the_cpu_uncompiled_on_both_sides() -> None:
    every = gpu_sections.SMOKE_LOG_EVERY
    shape, (case,) = gpu_sections.RESNET_SMOKE, gpu_sections.GPTS_SMOKE
    ours = parse_data_parallel("pytorch", job_args(gpu_sections.our_resnet(shape, False, every)))
    base = gpu_baselines.parse(
        [*gpu_sections.baseline_resnet(shape, False, every, cuda=False)[3:], "--metrics-json", "x"]
    )
    assert (base.device, base.compile, base.model, base.log_every) == ("cpu", False, ours.model, ours.log_every)
    ours_gpt = model_parallel.parse_settings(job_args(gpu_sections.our_gpt(case, every)))
    base_gpt = gpu_baselines.parse([*gpu_sections.baseline_gpt(case, every, cuda=False)[3:], "--metrics-json", "x"])
    assert (base_gpt.device, base_gpt.compile, base_gpt.log_every) == ("cpu", False, ours_gpt.log_every)
    assert ours_gpt.compile is None  # the job's default: off without CUDA, as the baseline here


def test_the_baseline_reads_the_loss_on_the_host_where_the_jobs_log() -> None:
    reads: list[int] = []
    steps = itertools.count(1)

    class Loss:
        def __init__(self, step: int) -> None:
            self.step = step

        def item(self) -> float:
            reads.append(self.step)
            return 0.0

    args = argparse.Namespace(steps=35, timing_warmup_steps=5, log_every=10)
    gpu_baselines.timed_loop(lambda: Loss(next(steps)), args, torch.device("cpu"))
    assert reads == [10, 20, 30]  # the steps where the jobs log: done % log_every == 0


def test_baseline_loops_run_and_report_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpt.json"
    tiny = ["--steps", "3", "--timing-warmup-steps", "1", "--log-every", "2", "--no-compile", "--device", "cpu"]
    tiny += ["--metrics-json", str(out)]
    gpu_baselines.main(["gpt", "--model", "gpt-tiny", "--seq-len", "16", "--batch-size", "2", *tiny])
    result = json.loads(out.read_text())
    assert result["tokens_per_sec"] > 0 and result["mfu"] is None and result["loss"] > 0
    gpu_baselines.main(["resnet", "--model", "resnet50", "--image-size", "32", "--batch-size", "2", *tiny])
    result = json.loads(out.read_text())
    # finite, not positive: torchvision's ResNet-50 (where it imports) learns a batch of 2 to a loss of 0
    assert result["images_per_sec"] > 0 and math.isfinite(result["loss"]) and result["model"]
    gpu_baselines.main(["resnet", "--model", "resnet_tiny", "--image-size", "16", "--batch-size", "2", *tiny])
    result = json.loads(out.read_text())  # torchvision has no resnet_tiny: ours, on its uint8 input
    assert result["model"].startswith("training.torch.models.resnet_tiny") and result["input"] == "uint8"
