"""The deployable model a run leaves behind: ``--export-dir`` holds the framework's model files and
``model.json``, which says what the model is, how to feed it and where it came from.
:mod:`training.predict` reads it.

Rank 0 writes the export at the end of the run (and at every epoch end with ``--export-every-epoch``)
into a hidden sibling directory, then renames it into place, so a reader never sees half an export;
the other ranks wait for it, as for a checkpoint. The savers live beside each framework's job
(:func:`training.pytorch.export_model`, :meth:`training.tf.common.Setup.save_export`): this module
imports no framework.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from training.config.args import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from training.config.settings import TrainingSettings
from training.data.imagenet import MEAN, STD, VAL_RESIZE_RATIO, DataPlan
from training.errors import OutputPathError
from training.run.outputs import MODEL_JSON, export_dir_problem, fsync_path, output_error
from training.world.distributed import Dist

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
GIT_REVISION_ENV = "GIT_REVISION"
RUN_ID_ENV = "RUN_ID"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or image directory) that holds training/
IMAGE_CLASSIFICATION = "image-classification"  # model.json's "task" (exports before it had none are this)


@dataclass(frozen=True)
class ModelFiles:
    """What a framework's saver wrote: the file to load, its format, and what the model returns."""

    format: str  # "torch.export" or "saved_model"
    file: str  # relative to the export directory
    outputs: str  # "logits" or "probabilities"
    extra: dict[str, str] = field(default_factory=dict)  # other files by role (none today: one copy of the weights)


Saver = Callable[[Path], ModelFiles]


@dataclass(frozen=True)
class ExportSpec:
    """What model.json says about the model, whatever its framework."""

    framework: str
    model: str
    classes: list[str]  # in label order: output i is classes[i]
    image_size: int

    @classmethod
    def of(cls, settings: TrainingSettings, plan: DataPlan) -> ExportSpec:
        found = plan.train.classes if plan.train is not None else []
        # Synthetic data has no class names, and --num-classes may be wider than train/.
        classes = list(found) + [f"class_{i}" for i in range(len(found), plan.num_classes)]
        return cls(settings.framework, settings.model, classes, settings.image_size)


def preprocessing(image_size: int) -> dict[str, Any]:
    """How an image becomes the model's input: training.data.imagenet.decode_val, then the model normalizes."""
    return {
        "decode": "RGB",
        "resize_short_side": image_size / VAL_RESIZE_RATIO,
        "center_crop": image_size,
        "interpolation": "bilinear",
        "input": {"dtype": "uint8", "layout": "NHWC", "shape": [None, image_size, image_size, 3]},
        "mean": list(MEAN),  # on the 0-255 scale, applied inside the model
        "std": list(STD),
        "normalized_in_model": True,
    }


def git_revision(env: Mapping[str, str] = os.environ, root: Path = PACKAGE_ROOT) -> str | None:
    """``$GIT_REVISION`` (the batch script sets it), else HEAD of the checkout that holds training/."""
    if env.get(GIT_REVISION_ENV):
        return env[GIT_REVISION_ENV]
    if not (root / ".git").exists():  # an image: the code was copied without its history
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def model_card(
    spec: ExportSpec, files: ModelFiles, metrics: Mapping[str, Any], env: Mapping[str, str] = os.environ
) -> dict[str, Any]:
    """The content of model.json for an image classifier."""
    task = {
        "task": IMAGE_CLASSIFICATION,
        "classes": spec.classes,
        "image_size": spec.image_size,
        "preprocessing": preprocessing(spec.image_size),
    }
    return model_json(spec.framework, spec.model, files, task, metrics, env)


def model_json(
    framework: str,
    model: str,
    files: ModelFiles,
    task: Mapping[str, Any],
    metrics: Mapping[str, Any],
    env: Mapping[str, str] = os.environ,
) -> dict[str, Any]:
    """model.json: the files, what the model does and how to feed it (``task``), where it came from."""
    return {
        "schema_version": SCHEMA_VERSION,
        "framework": framework,
        "model": model,
        "format": files.format,
        "file": files.file,
        "outputs": files.outputs,
        "files": files.extra,
        **task,
        "metrics": dict(metrics),
        "run_id": env.get(RUN_ID_ENV) or None,
        "git_revision": git_revision(env),
        "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_export(directory: Path, save: Saver, describe: Callable[[ModelFiles], dict[str, Any]]) -> None:
    """Write an export into a hidden sibling of ``directory``, then rename it into place.

    An older export there is moved aside first and removed after; in between, ``directory`` is
    briefly absent, never incomplete. Raises OSError from the file system, and
    :class:`OutputPathError` when ``directory`` holds something other than an export.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(directory)
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    staging.mkdir()
    try:
        files = save(staging)
        (staging / MODEL_JSON).write_text(json.dumps(describe(files), indent=2) + "\n")
        _fsync_tree(staging)
        _replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless something failed


def _replace(staging: Path, directory: Path) -> None:
    problem = export_dir_problem(directory)
    if problem is not None:  # checked before the run too; someone may have filled it since
        raise OutputPathError(f"--export-dir {directory}: {problem}")
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        directory.rename(old)
    staging.rename(directory)
    fsync_path(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(directory: Path) -> None:
    """Staging and set-aside directories of an export that was interrupted (a killed run)."""
    for prefix in (f".{directory.name}.tmp-", f".{directory.name}.old-"):
        for leftover in directory.parent.glob(f"{prefix}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk before the rename publishes them."""
    for path in [*root.rglob("*"), root]:
        fsync_path(path)


class Exporter:
    """Every rank calls it at the same points; rank 0 writes, the others wait until it is done."""

    def __init__(self, settings: TrainingSettings, dist: Dist, spec: ExportSpec, save: Saver) -> None:
        self.settings = settings
        self.dist = dist
        self.spec = spec
        self.save = save

    @property
    def epoch_hook(self) -> Callable[[int, dict[str, Any]], None] | None:
        """For :class:`training.run.loop.TrainingRun`'s ``on_epoch_end``: None unless asked for."""
        return self._epoch_end if self.settings.export_every_epoch else None

    def _epoch_end(self, epoch: int, progress: dict[str, Any]) -> None:
        self._export(progress)  # not called at the run's end: the final export carries all the metrics

    def final(self, metrics: Mapping[str, Any]) -> None:
        """The export of the finished run, with the metrics :meth:`TrainingRun.finish` returned."""
        if self.settings.export_dir is not None:
            self._export(metrics)

    def _export(self, metrics: Mapping[str, Any]) -> None:
        directory: Path = self.settings.export_dir
        if self.dist.rank == 0:
            try:
                write_export(directory, self.save, lambda files: model_card(self.spec, files, metrics))
            except OSError as exc:
                raise output_error("--export-dir", directory, exc) from None
            log.info("exported the model after step %s to %s", metrics.get("steps"), directory)
        # Keep ranks together here, as for a checkpoint: the export's time is not charged to the next step.
        self.dist.allgather_object(None)


def read_model_card(directory: Path) -> dict[str, Any]:
    """model.json of an export directory; ValueError or OSError when it is not readable as one."""
    card = json.loads((directory / MODEL_JSON).read_text())
    if not isinstance(card, dict):
        raise ValueError("not a JSON object")
    version = card.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"schema_version {version!r}, this version reads {SCHEMA_VERSION}")
    required = ["framework", "format", "file", "outputs"]
    if card.get("task", IMAGE_CLASSIFICATION) == IMAGE_CLASSIFICATION:
        required += ["classes", "image_size"]
    missing = [key for key in required if key not in card]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if "image_size" in card:  # the crop size: a bad one would reach OpenCV's resize
        size = card["image_size"]
        if type(size) is not int or not MIN_IMAGE_SIZE <= size <= MAX_IMAGE_SIZE:
            raise ValueError(f"image_size {size!r} is not a whole number in {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE}")
    if "classes" in card and not (isinstance(card["classes"], list) and card["classes"]):
        raise ValueError("classes is not a non-empty list")
    return card
