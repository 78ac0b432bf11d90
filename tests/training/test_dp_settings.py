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
from training.config.settings import TrainingSettings, parse_settings
from training.errors import ExitCode
from training.run.loop import TrainingRun
from training.torch.sync import LOCAL_SGD, SyncSettings

SYNC_FLAGS = {"sync", "sync_every", "sync_warmup_steps", "outer_optimizer", "outer_lr", "outer_momentum"}
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
    assert flags - SYNC_FLAGS <= fields - {"framework", "sync"}  # --sync... become SyncSettings
    if framework == "pytorch":
        assert flags - SYNC_FLAGS == fields - {"framework", "sync"}  # and no field without a flag


def test_settings_are_typed_and_frozen(tmp_path: Path) -> None:
    flags = ["--backend", "ddp", "--sync", "local-sgd", "--sync-every", "4", "--lr-decay-epochs", "2,4"]
    settings = parse_settings("pytorch", [*flags, "--checkpoint-dir", str(tmp_path), "--no-compile"])
    assert (settings.framework, settings.backend, settings.decode, settings.compile) == ("pytorch", "ddp", "cpu", False)
    assert settings.sync == SyncSettings(LOCAL_SGD, every=4)
    assert settings.lr_decay_epochs == (2.0, 4.0) and settings.checkpoint_dir == tmp_path
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
