"""The files a job writes (checkpoints, the metrics JSON): checked before anything starts, so a
path that cannot be written is found in a second rather than after hours of training.

Rank 0 writes every output, so rank 0 checks them. Logs go to stdout/stderr, which belong to
the launcher. A write that still fails later (the disk filled up meanwhile) is reported the
same way, with the path and what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Protocol

from training.errors import BadInput, OutputPathError

MIN_FREE_ENV = "TRAINING_MIN_FREE_MB"
DEFAULT_MIN_FREE_MB = 1024  # a few ResNet-50 checkpoints (about 200 MB each with momentum)
MB = 2**20
MODEL_JSON = "model.json"  # what marks a directory as a model export (training.run.export)


class OutputFlags(Protocol):
    """The output flags every job has (its settings, built from the flags)."""

    @property
    def checkpoint_dir(self) -> Path | None: ...
    @property
    def export_dir(self) -> Path | None: ...
    @property
    def metrics_json(self) -> Path | None: ...
    @property
    def tensorboard_dir(self) -> Path | None: ...
    @property
    def summary_png(self) -> Path | None: ...
    @property
    def slow_ranks_json(self) -> Path | None: ...


def check_output_paths(settings: OutputFlags, env: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`OutputPathError` unless every output can be written and has room."""
    need = min_free_bytes(env)
    if settings.checkpoint_dir is not None:
        check_directory(settings.checkpoint_dir, "--checkpoint-dir", settings.checkpoint_dir, need)
    if settings.export_dir is not None:
        problem = export_dir_problem(settings.export_dir)
        if problem is not None:
            raise OutputPathError(f"--export-dir {settings.export_dir}: {problem}")
        # The export is written beside the directory, then renamed over it: the parent must take files.
        check_directory(settings.export_dir.parent, "--export-dir", settings.export_dir, need)
    for flag, path in (("--metrics-json", settings.metrics_json), ("--slow-ranks-json", settings.slow_ranks_json)):
        if path is not None:
            if path.is_dir():
                raise OutputPathError(f"{flag} {path} is a directory: pass the path of a file")
            check_directory(path.parent, flag, path, need)
    if settings.tensorboard_dir is not None:
        require_package("tensorboard", "--tensorboard-dir")
        check_directory(settings.tensorboard_dir, "--tensorboard-dir", settings.tensorboard_dir, need)
    if settings.summary_png is not None:
        if settings.summary_png.is_dir():
            raise OutputPathError(f"--summary-png {settings.summary_png} is a directory: pass the path of a file")
        require_package("matplotlib", "--summary-png")
        check_directory(settings.summary_png.parent, "--summary-png", settings.summary_png, need)


def require_package(package: str, flag: str) -> None:
    """An output whose writer needs an optional package is refused now, not after the training."""
    if find_spec(package) is None:
        raise BadInput(
            f"{flag} needs the Python package {package}, which this environment lacks: "
            f"install it (requirements-train.txt pins it) or leave {flag} out"
        )


def min_free_bytes(env: Mapping[str, str]) -> int:
    text = env.get(MIN_FREE_ENV, str(DEFAULT_MIN_FREE_MB))
    if not text.isdigit():
        raise BadInput(f"{MIN_FREE_ENV}={text!r}: expected a number of MiB (0 turns the free-space check off)")
    return int(text) * MB


def check_directory(directory: Path, flag: str, value: Path, need: int) -> None:
    """Create ``directory`` (where ``flag``'s ``value`` goes) if needed, write a file in it, and
    check its file system's free space."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-") as probe:
            probe.write(b"x")
            probe.flush()
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        raise output_error(flag, value, exc) from None
    if free < need:
        raise OutputPathError(
            f"{flag} {value}: only {free // MB} MiB free, at least {need // MB} MiB needed "
            f"(free some space, choose another {flag}, or lower {MIN_FREE_ENV})"
        )


def output_error(flag: str, path: Path, exc: OSError) -> OutputPathError:
    """'cannot write <flag> <path>: <reason> (<what to do>)' for a failed write."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = f"free some space or choose another {flag}"
    else:
        advice = f"choose another {flag} or fix its permissions"
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):  # EEXIST: mkdir met a file
        reason = "a part of the path is a file, not a directory"
    else:
        reason = (exc.strerror or str(exc)).lower()
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
    return OutputPathError(f"cannot write {flag} {path}: {reason}{where} ({advice})")


def export_dir_problem(directory: Path) -> str | None:
    """Why an export may not replace ``directory`` (None: it may). Only an earlier export or an
    empty directory is replaced, so a mistyped --export-dir cannot delete anyone's files."""
    if not directory.exists():
        return None
    if not directory.is_dir():
        return "it is a file: pass a directory"
    try:
        if (directory / MODEL_JSON).is_file() or not any(directory.iterdir()):
            return None
    except OSError as exc:
        return f"cannot list it ({(exc.strerror or str(exc)).lower()}): fix its permissions or choose another"
    return f"it holds files but no {MODEL_JSON}, so it is not an earlier export: choose a new or empty directory"


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries (the renames into it: without this a power loss can
    forget them), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
