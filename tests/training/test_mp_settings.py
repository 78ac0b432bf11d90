"""training.model_parallel's settings: built once from the flags, frozen, and the compile and
activation-checkpointing values resolved for the device are the ones the run trains with and reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.training.jobs import run_in_this_process
from training import model_parallel
from training.config.layout import Layout
from training.config.settings import TrainingSettings
from training.errors import ExitCode

CPU = torch.device("cpu")
ONE = Layout(1, 1, 1, 1)


def test_settings_are_typed_frozen_and_filled_in(tmp_path: Path) -> None:
    settings = model_parallel.parse_settings(
        ["--model", "gpt-tiny", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--checkpoint-dir", str(tmp_path)]
    )
    assert settings.checkpoint_dir == tmp_path and isinstance(settings.checkpoint_dir, Path)
    assert (settings.parallel.microbatches, settings.seq_len) == (4, 256)  # 2 x --pp interleaved; gpt-tiny's context
    assert (settings.compile, settings.parallel.activation_checkpointing, settings.resolved) == (None, "auto", False)
    assert settings.gpt is not None and settings.gpt.n_layers > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.compile = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], (False, "none")),  # the defaults on a CPU: no compile, and auto is none without a GPU
        (["--compile", "--activation-checkpointing", "full"], (True, "full")),
        (["--no-compile", "--activation-checkpointing", "selective"], (False, "selective")),
    ],
)
def test_for_device_resolves_a_copy(flags: list[str], expected: tuple[bool, str]) -> None:
    settings = model_parallel.parse_settings(["--model", "gpt-tiny", *flags])
    resolved = model_parallel.for_device(settings, ONE, CPU)
    assert (resolved.compile, resolved.parallel.activation_checkpointing) == expected and resolved.resolved
    unresolved = {"compile": settings.compile, "parallel": settings.parallel}
    assert dataclasses.replace(resolved, **unresolved) == settings  # nothing else changed


def test_the_job_builds_its_settings_once_and_reports_the_resolved_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process, in this one (world size 1): the settings parsed are the only ones built from
    flags, the run gets their resolved copy, and the metrics report its compile and AC values."""
    metrics_json = tmp_path / "metrics.json"
    argv = ["--model", "gpt-tiny", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--log-every", "1"]
    settings = model_parallel.parse_settings([*argv, "--timing-warmup-steps", "0", "--metrics-json", str(metrics_json)])
    built: list[TrainingSettings] = []
    from_args = TrainingSettings.from_args

    def counted(framework: str, args: argparse.Namespace) -> TrainingSettings:
        built.append(from_args(framework, args))
        return built[-1]

    monkeypatch.setattr(TrainingSettings, "from_args", counted)
    runs: list[TrainingSettings] = []
    run_init = model_parallel.Run.__init__

    def spy(run: model_parallel.Run, resolved: TrainingSettings, *rest: object) -> None:
        runs.append(resolved)
        run_init(run, resolved, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(model_parallel.Run, "__init__", spy)
    assert run_in_this_process(monkeypatch, settings, model_parallel.start, model_parallel.train) == ExitCode.OK
    assert built == []  # nothing after the parser builds settings from flags again
    no_checkpointing = dataclasses.replace(settings.parallel, activation_checkpointing="none")
    assert runs == [dataclasses.replace(settings, compile=False, parallel=no_checkpointing)]
    assert (settings.compile, settings.parallel.activation_checkpointing) == (
        None,
        "auto",
    )  # the parsed ones, untouched
    metrics = json.loads(metrics_json.read_text())
    assert (metrics["compiled"], metrics["activation_checkpointing"]) == (False, "none")
    assert metrics["steps"] == 2 and metrics["seq_len"] == 16 and len(metrics["step_losses"]) == 2
