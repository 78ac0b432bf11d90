"""The data-parallel jobs' settings: built once from the flags, typed, frozen, and the one object
every part of a run reads."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from tests.training.jobs import run_in_this_process
from training import pytorch
from training.config.args import FRAMEWORKS, build_parser
from training.config.settings import OptimizerSettings, ParallelSettings, TrainingSettings, parse_settings
from training.config.sync import LOCAL_SGD, SyncSettings
from training.errors import ExitCode
from training.run.loop import TrainingRun

SYNC_FLAGS = {"sync", "sync_every", "sync_warmup_steps", "outer_optimizer", "outer_lr", "outer_momentum"}
OPTIMIZER_FLAGS = {"optimizer", "lr", "momentum", "weight_decay", "warmup_epochs", "lr_decay_epochs"}
LAYOUT_FLAGS = {"tp", "pp", "dp_shard", "pp_schedule", "microbatches", "activation_checkpointing"}
SECTIONS = {"framework", "sync", "optimizer", "parallel"}  # fields that are no flag of their own
# The modules of a data-parallel run: they read the settings, never the argparse Namespace.
READERS = (
    "pytorch",
    "tensorflow",
    "keras",
    "tf/common",
    "run/loop",
    "data/imagenet",
    "run/export",
    "run/outputs",
    "run/job",
)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_flag_is_a_field(framework: str) -> None:
    flags = {action.dest for action in build_parser(framework)._actions} - {"help"}
    fields = {field.name for field in dataclasses.fields(TrainingSettings)}
    # --sync... become SyncSettings, the optimizer's flags OptimizerSettings, the layout's ParallelSettings
    in_sections = SYNC_FLAGS | OPTIMIZER_FLAGS | LAYOUT_FLAGS
    assert flags - in_sections <= fields - SECTIONS
    assert OPTIMIZER_FLAGS - {"optimizer"} | {"name"} == {field.name for field in dataclasses.fields(OptimizerSettings)}
    assert {field.name for field in dataclasses.fields(ParallelSettings)} == LAYOUT_FLAGS
    if framework == "pytorch":
        assert flags - in_sections == fields - SECTIONS  # and no field without a flag
        assert in_sections <= flags


def test_settings_are_typed_and_frozen(tmp_path: Path) -> None:
    flags = ["--backend", "ddp", "--sync", "local-sgd", "--sync-every", "4", "--lr-decay-epochs", "2,4"]
    settings = parse_settings("pytorch", [*flags, "--checkpoint-dir", str(tmp_path), "--no-compile"])
    assert (settings.framework, settings.backend, settings.decode, settings.compile) == ("pytorch", "ddp", "cpu", False)
    assert settings.sync == SyncSettings(LOCAL_SGD, every=4)
    assert settings.optimizer.lr_decay_epochs == (2.0, 4.0) and settings.checkpoint_dir == tmp_path
    assert (settings.steps, settings.num_classes, settings.data_workers) == (None, None, None)  # chosen later
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.batch_size = 8  # type: ignore[misc]
    hash(settings)  # frozen all the way down: no list or Namespace inside


@pytest.mark.parametrize("framework", ["tensorflow", "keras"])
def test_tensorflow_and_keras_get_what_their_jobs_do(framework: str) -> None:
    settings = parse_settings(framework, ["--fp16-allreduce"])
    assert (settings.framework, settings.backend, settings.sync) == (framework, "horovod", SyncSettings())
    assert (settings.decode, settings.compile, settings.profile_dir) == (None, None, None)
    assert settings.fp16_allreduce


@pytest.mark.parametrize("module", READERS)
def test_the_jobs_modules_take_no_namespace(module: str) -> None:
    source = (Path(__file__).parents[2] / "training" / f"{module}.py").read_text()
    assert "argparse" not in source and "Namespace" not in source


def test_the_job_builds_its_settings_once_and_every_part_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One DDP process, in this one: the settings parsed are the only ones built from flags, and the
    run's bookkeeping gets that very object."""
    metrics_json = tmp_path / "metrics.json"
    flags = ["--backend", "ddp", "--model", "resnet_tiny", "--image-size", "32", "--num-classes", "4"]
    flags += ["--batch-size", "2", "--steps", "2", "--log-every", "1", "--timing-warmup-steps", "0"]
    settings = parse_settings("pytorch", [*flags, "--metrics-json", str(metrics_json)])
    built: list[TrainingSettings] = []
    from_args = TrainingSettings.from_args

    def counted(framework: str, args: argparse.Namespace) -> TrainingSettings:
        built.append(from_args(framework, args))
        return built[-1]

    monkeypatch.setattr(TrainingSettings, "from_args", counted)
    runs: list[TrainingSettings] = []
    run_init = TrainingRun.__init__

    def spy(run: TrainingRun, given: TrainingSettings, *rest: object, **named: object) -> None:
        runs.append(given)
        run_init(run, given, *rest, **named)  # type: ignore[arg-type]

    monkeypatch.setattr(TrainingRun, "__init__", spy)
    assert run_in_this_process(monkeypatch, settings, pytorch.start_backend, pytorch.train) == ExitCode.OK
    assert built == []  # nothing after the parser builds settings from flags again
    assert len(runs) == 1 and runs[0] is settings
    metrics = json.loads(metrics_json.read_text())
    assert (metrics["framework"], metrics["steps"], metrics["batch_size_per_worker"]) == ("pytorch", 2, 2)


SGD_DEFAULTS = ("sgd", 0.025, 0.9, 1e-4, 5.0, (30.0, 60.0, 80.0))
ADAMW_DEFAULTS = ("adamw", 3e-4, None, 0.1, 0.0, ())


@pytest.mark.parametrize(
    ("flags", "batch_size", "optimizer"),
    [
        ([], 64, SGD_DEFAULTS),  # an image model: Goyal et al.'s recipe
        (["--model", "gpt-tiny"], 8, ADAMW_DEFAULTS),  # a transformer: GPT-3's AdamW at a constant LR
        (["--model", "gpt-tiny", "--optimizer", "sgd"], 8, SGD_DEFAULTS),  # the optimizer's own defaults
        (["--model", "resnet_tiny", "--optimizer", "adamw", "--batch-size", "4"], 4, ADAMW_DEFAULTS),
    ],
)
def test_the_defaults_follow_the_model_and_the_optimizer(
    flags: list[str], batch_size: int, optimizer: tuple[object, ...]
) -> None:
    settings = parse_settings("pytorch", flags)
    chosen = settings.optimizer
    values = (
        chosen.name,
        chosen.lr,
        chosen.momentum,
        chosen.weight_decay,
        chosen.warmup_epochs,
        chosen.lr_decay_epochs,
    )
    assert (settings.batch_size, values) == (batch_size, optimizer)
    assert parse_settings("keras", []).optimizer == parse_settings("pytorch", []).optimizer  # TensorFlow: SGD alike


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "gpt-tiny", "--momentum", "0.9"], "--momentum is SGD's: --optimizer adamw has betas 0.9/0.95"),
        (["--microbatches", "4"], "--microbatches: only used with --pp 2 or more"),
        (["--pp-schedule", "gpipe", "--tp", "2"], "--pp-schedule: only used with --pp 2 or more"),
        (["--seq-len", "16"], "--seq-len is for the transformers, not resnet50"),
        (["--model", "gpt-tiny", "--data", "imagenet", "--data-dir", "/tmp"], "gpt-tiny is a transformer"),
    ],
)
def test_flags_that_do_not_fit_the_model_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings("pytorch", flags)
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "2"], "--tp 2: a mesh layout (--tp, --pp, --dp-shard) runs under torchrun"),
        (["--pp", "2", "--dp-shard", "1"], "--pp 2 --dp-shard 1: a mesh layout"),
        (["--activation-checkpointing", "full"], "--activation-checkpointing is for mesh layouts"),
        (["--model", "gpt-tiny"], "--model gpt-tiny: the transformers train under torchrun"),
        (["--optimizer", "adamw"], "--optimizer adamw: this job trains with SGD"),
    ],
)
def test_the_data_parallel_job_refuses_what_only_the_mesh_job_trains(flags: list[str], message: str) -> None:
    problem = pytorch.refusal(parse_settings("pytorch", flags))
    assert problem is not None and problem.startswith(message)
    assert pytorch.refusal(parse_settings("pytorch", ["--precision", "bf16"])) is None
