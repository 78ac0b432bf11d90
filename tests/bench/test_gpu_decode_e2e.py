"""bench.gpu.decode_e2e without a GPU: the runs it asks for, the ratios it reports, its refusal here.

The figures themselves need a CUDA node (docs/performance.md); this checks everything around them
with a stand-in for the job runs, and the job arguments against the job's own parser.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import decode_e2e as e2e
from bench.gpu import sections as gpu_sections
from bench.gpu.report import Scale
from bench.harness.steps import Shape
from training.config.settings import parse_settings

TINY = e2e.Plan(images=8, batch=4, epochs=3, warmup=1, model="resnet_tiny", image_size=16)


def fake_run(calls: list[list[str]]) -> e2e.Run:
    rates = {"synthetic": 1000.0, "cpu": 900.0, "gpu": 700.0, "auto": 890.0}

    def run(args: list[str]) -> tuple[dict[str, Any], float]:
        calls.append(args)
        key = args[args.index("--decode") + 1] if "--decode" in args else "synthetic"
        rate = rates[key] * (1.5 if "--compile" in args else 1.0)
        return {"images_per_sec": rate, "decoder": None if key == "synthetic" else f"decoder of {key}"}, 2.0

    return run


def test_each_mode_runs_its_synthetic_baseline_then_every_decoder(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    table = e2e.rows(tmp_path, TINY, fake_run(calls))
    assert [(r["mode"], r["input"]) for r in table] == [
        (mode, source)
        for mode in ("eager", "compiled")
        for source in ("synthetic", "jpeg --decode cpu", "jpeg --decode gpu", "jpeg --decode auto")
    ]
    assert [r["vs_synthetic"] for r in table[:4]] == [1.0, 0.9, 0.7, 0.89]
    assert [r["vs_synthetic"] for r in table[4:]] == pytest.approx([1.0, 0.9, 0.7, 0.89])  # compiled: its own baseline
    assert all(r["images_per_host_cpu_s"] == TINY.steps * TINY.batch / 2.0 for r in table)
    assert len(list((tmp_path / "train").rglob("*.JPEG"))) == TINY.images
    assert ["--compile" in args for args in calls] == [False] * 4 + [True] * 4


def test_as_a_bench_gpu_section_each_decoder_stands_beside_the_compiled_synthetic_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(e2e, "DEFAULT", TINY)  # the full-size plan, as small as the test needs
    calls: list[list[str]] = []
    section = e2e.section_rows(tmp_path, Scale(smoke=False, cuda=True, deadline=math.inf), fake_run(calls))
    assert [(row.name, row.ratio) for row in section] == [
        (f"resnet_tiny on JPEGs, jpeg --decode {decode}, compiled", pytest.approx(ratio))
        for decode, ratio in (("cpu", 0.9), ("gpu", 0.7), ("auto", 0.89))
    ]
    assert all("--compile" in args for args in calls) and len(calls) == 4  # compiled only: synthetic first
    assert section[0].baseline_label == "synthetic data, compiled"
    assert section[0].terms.startswith("the same job both sides: bf16 autocast; compiled;")
    assert "steps 2-6 timed" in section[0].terms
    assert "decoder decoder of cpu" in section[0].note and "CUDA" not in section[0].note


def test_its_smoke_on_the_cpu_runs_decode_cpu_only_eager_and_says_why(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    (row,) = e2e.section_rows(tmp_path, Scale(smoke=True, cuda=False, deadline=math.inf), fake_run(calls))
    assert row.name == f"{e2e.SMOKE.model} on JPEGs, jpeg --decode cpu, eager" and row.ratio == pytest.approx(0.9)
    assert [args.count("--no-compile") for args in calls] == [1, 1]
    assert "--decode gpu and auto not run: they need CUDA" in row.note
    assert len(list((tmp_path / "jpegs" / "train").rglob("*.JPEG"))) == e2e.SMOKE.images


@pytest.mark.parametrize("decode", [None, *e2e.DECODES])
def test_the_job_accepts_every_run_and_takes_the_same_steps(tmp_path: Path, decode: str | None) -> None:
    data_dir = None if decode is None else tmp_path
    settings = parse_settings("pytorch", e2e.job_args(TINY, "compiled", data_dir, decode))
    assert (settings.decode, settings.compile, settings.batch_size, settings.backend) == (
        decode or "cpu",
        True,
        4,
        "ddp",
    )
    assert settings.num_classes == TINY.num_classes == 1000  # the same model on every input
    if decode is None:
        assert (settings.data, settings.steps, settings.epochs) == ("synthetic", TINY.steps, 1)
    else:
        assert (settings.data, settings.data_dir, settings.epochs) == ("imagenet", tmp_path, TINY.epochs)
        assert TINY.images // TINY.batch * settings.epochs == TINY.steps


@pytest.mark.parametrize(
    ("plan", "shape"),
    [(e2e.DEFAULT, gpu_sections.RESNET), (e2e.SMOKE, gpu_sections.RESNET_SMOKE)],
    ids=["full", "smoke"],
)
def test_its_compiled_model_is_the_one_the_resnet50_section_compiled(plan: e2e.Plan, shape: Shape) -> None:
    """So that bench.gpu compiles it once: the decode section's jobs find it in Inductor's cache."""
    ours = gpu_sections.our_resnet(shape, True, gpu_sections.LOG_EVERY)
    resnet = parse_settings("pytorch", ours[ours.index("training.pytorch") + 1 :])
    decode = parse_settings("pytorch", e2e.job_args(plan, "compiled", None, None))
    fields = ("model", "image_size", "batch_size", "num_classes", "precision", "compile", "backend", "data")
    assert [getattr(decode, name) for name in fields] == [getattr(resnet, name) for name in fields]


def test_without_cuda_it_exits_3_with_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert e2e.main([]) == 3
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("error: no CUDA device here")


def test_host_cpu_time_counts_work() -> None:
    before = e2e.host_cpu_seconds()
    sum(i * i for i in range(3_000_000))
    assert e2e.host_cpu_seconds() > before


def test_the_table_prints_a_line_per_row(tmp_path: Path) -> None:
    table = e2e.rows(tmp_path, TINY, fake_run([]), modes=["eager"])
    lines = e2e.format_table(table).splitlines()
    assert len(lines) == 5 and "jpeg --decode auto" in lines[-1] and lines[-1].endswith("decoder of auto")
