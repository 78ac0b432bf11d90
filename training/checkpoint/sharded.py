"""Sharded checkpoints of the model-parallel jobs (torch.distributed.checkpoint), atomic per directory.

On disk, ``<directory>/step-0000000100/`` holds one checkpoint: DCP's files (``__<rank>_<n>.distcp``
written by every rank, ``.metadata`` written by rank 0) and ``COMMITTED.json`` (the step, the world
size, the time and the job's ``extra``: its model and layout). A save goes like this:

1. rank 0 removes what killed saves left behind (hidden ``.step-*`` directories), picks a fresh
   hidden name ``.step-0000000100.tmp-<random>`` and broadcasts it;
2. every rank writes its shards there with ``dcp.save`` (each file fsynced); DCP gathers every
   rank's result before rank 0 writes ``.metadata``, so that gather is the barrier;
3. rank 0 writes ``COMMITTED.json`` (temporary file, fsync, rename), renames the directory to
   ``step-0000000100`` and fsyncs the parent, then prunes to the newest ``keep`` (each old one
   renamed to a hidden name before it is deleted, so half a deletion is never listed);
4. rank 0 broadcasts the outcome, so every rank returns the same path or raises the same error.

Only a directory with a final name *and* a commit marker counts (:meth:`ShardedCheckpoints.latest`):
a run killed at any moment leaves either a hidden directory, which is never read and is removed by
the next save, or a complete checkpoint.

Loading reshards. Every key is a fully qualified name (``layers.3.attention.wq.weight``, and for the
optimizer ``state.<fqn>.exp_avg`` / ``param_groups.<fqn>.lr``, DCP's flattened optimizer state), so a
rank asks for exactly the keys of the parts it holds, in whatever sharding they now have (FSDP over
another world size, TP, a pipeline stage, a plain module), and DCP reads the overlapping pieces of
the saved shards. Before reading, each rank checks that the checkpoint has every key it needs, with
the same global shape; a checkpoint of another model is refused (:class:`CheckpointRefused`), never
half-loaded.

The directory must be visible to every rank (one disk, or NFS across nodes): DCP reads and writes
each rank's files in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from training.errors import CheckpointRefused, JobError, OutputPathError
from training.run.outputs import fsync_path, output_error

log = logging.getLogger(__name__)

FORMAT = 1
COMMIT_MARKER = "COMMITTED.json"
METADATA = ".metadata"  # DCP's index, written by rank 0 once every rank's shards are written
_FINAL = re.compile(r"^step-(\d{10})$")
_HIDDEN_PREFIX = ".step-"  # temporaries and directories being deleted; never read, removed at the next save
# Flattened optimizer state: keyed by parameter FQN, not by the optimizer's parameter index, which
# differs between pipeline stages and layouts (and would collide between stages).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_MODEL, _OPTIM = "model.", "optim."
_EXAMPLES = 3  # keys named in a refusal
# What rank 0 alone decides, as it is broadcast: (True, value) or (False, the error message).
Outcome = tuple[bool, Any]


def checkpoint_name(step: int) -> str:
    return f"step-{step:010d}"


class ShardedCheckpoints:
    """The sharded checkpoints of one run: collective save and load, newest complete one, pruning."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = Path(directory)
        self.keep = keep

    def committed(self) -> list[Path]:
        """Complete checkpoints, oldest first (local: no collective; the file system's view)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _FINAL.match(path.name)
            # Belt and braces: the rename already implies the marker; a directory copied by hand
            # without it (or without DCP's index) is not taken for a checkpoint.
            if match and (path / COMMIT_MARKER).is_file() and (path / METADATA).is_file():
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None (local: no collective)."""
        done = self.committed()
        return done[-1] if done else None

    def agreed_latest(self) -> Path | None:
        """Rank 0's :meth:`latest` on every rank (collective): what a job resumes from, so that no
        rank decides alone on a file system view (NFS caches) that another rank does not share."""
        latest = self.latest() if _rank() == 0 else None
        found = _from_rank0(None if latest is None else str(latest))
        return None if found is None else Path(found)

    def save(
        self, step: int, model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], extra: dict
    ) -> Path:
        """Write every rank's shards of ``model_parts`` and ``optimizers`` as the checkpoint of ``step``
        (collective: every rank calls it with its own parts). ``extra`` must be JSON-serializable
        (dataclasses and paths are converted) and the same on every rank; it is returned by
        :meth:`load`. Raises :class:`OutputPathError` on every rank if the save fails."""
        marker = _marker(step, extra)  # a bad ``extra`` fails here, on every rank, before any collective
        state, _ = _collect(model_parts, optimizers)
        tmp = Path(_outcome(OutputPathError, self._begin(step) if _rank() == 0 else None))
        try:
            with _single_process_quietly():
                dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
        except CheckpointException as exc:  # DCP gathers every rank's failure: all ranks raise this
            raise self._save_error(exc) from None
        return Path(_outcome(OutputPathError, self._commit(tmp, step, marker) if _rank() == 0 else None))

    def load(
        self,
        path: Path,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        expect: Mapping[str, Any] | None = None,
    ) -> dict:
        """Load the checkpoint at ``path`` (rank 0's ``path`` wins, so every rank reads the same
        one) into this rank's parts, resharding as needed: the weights and the optimizers' state;
        their settings (lr...) stay this run's. Return the writer's ``extra``, with
        ``step`` and ``world_size`` filled in. ``expect``: entries the writer's ``extra`` must have
        (``{"model": "gpt-tiny"}``). Collective. Raises :class:`CheckpointRefused` on every rank
        if the checkpoint belongs to another model or cannot be read."""
        path, marker = _outcome(CheckpointRefused, _read_marker_at(Path(path)) if _rank() == 0 else None)
        state, part_keys = _collect(model_parts, optimizers)
        _agree(_expectation_problem(path, marker, expect) or _fit_problem(path, state))
        settings = _optimizer_settings(state)
        try:
            with _single_process_quietly():
                dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
        except CheckpointException as exc:
            raise CheckpointRefused(
                f"cannot read checkpoint {path} ({_first_failure(exc)}): delete it to resume from the one before",
                every_rank=True,
            ) from None
        state.update(settings)
        _apply(state, part_keys, model_parts, optimizers)
        extra = dict(marker["extra"])
        extra.setdefault("step", marker["step"])
        extra.setdefault("world_size", marker["world_size"])
        return extra

    def remove_leftovers(self) -> None:
        """Delete the hidden directories of killed saves and deletions. Rank 0 only, and only
        when no save of this directory is under way (:meth:`save` calls it first)."""
        if self.directory.is_dir():
            for path in self.directory.glob(f"{_HIDDEN_PREFIX}*"):
                shutil.rmtree(path, ignore_errors=True)

    def _begin(self, step: int) -> Outcome:
        """Rank 0: clean up, then create the temporary directory this save writes into."""
        tmp = self.directory / f"{_HIDDEN_PREFIX}{step:010d}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.remove_leftovers()
            tmp.mkdir()
        except OSError as exc:
            return (False, str(output_error("--checkpoint-dir", self.directory, exc)))
        return (True, str(tmp))

    def _commit(self, tmp: Path, step: int, marker: dict) -> Outcome:
        """Rank 0, after every rank's shards and DCP's index are written: mark, publish, prune."""
        final = self.directory / checkpoint_name(step)
        try:
            _write_json(tmp / COMMIT_MARKER, marker)
            if final.exists():  # the same step saved again (a finished run re-run): replace it
                _discard(final, self.directory)
            os.rename(tmp, final)
            fsync_path(self.directory)
            for old in self.committed()[: -self.keep]:
                _discard(old, self.directory)
        except OSError as exc:
            return (False, str(output_error("--checkpoint-dir", self.directory, exc)))
        log.debug("saved checkpoint %s", final)  # the job logs it
        return (True, str(final))

    def _save_error(self, exc: CheckpointException) -> OutputPathError:
        for failure in _failures(exc):
            if isinstance(failure, OSError):
                error = output_error("--checkpoint-dir", self.directory, failure)
                return OutputPathError(str(error), every_rank=True)
        return OutputPathError(
            f"cannot write --checkpoint-dir {self.directory}: {_first_failure(exc)}", every_rank=True
        )


def read_marker(path: Path) -> dict:
    """The commit marker of the checkpoint directory ``path`` (ValueError/OSError if unreadable)."""
    marker = json.loads((path / COMMIT_MARKER).read_text())
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} commit marker")
    return marker


def _marker(step: int, extra: Mapping[str, Any]) -> dict:
    if extra.get("step", step) != step:
        raise ValueError(f"extra['step'] is {extra['step']}, but the checkpoint is of step {step}")
    # Round-trip now: a value JSON cannot hold fails on every rank here, not on rank 0 after the write.
    extra = json.loads(json.dumps(dict(extra), default=_jsonable))
    return {
        "format": FORMAT,
        "step": step,
        "world_size": _world_size(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "extra": extra,
    }


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"checkpoint extra: {type(value).__name__} is not JSON-serializable")


def _read_marker_at(path: Path) -> Outcome:
    try:
        return (True, (path, read_marker(path)))
    except (OSError, ValueError) as exc:
        return (False, f"{path} is not a complete checkpoint ({exc}): pass one that ShardedCheckpoints.latest() lists")


def _collect(
    model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[dict[str, Any], list[list[str]]]:
    """One flat state dict of every part (``model.<fqn>``, ``optim.state.<fqn>.<name>``...), and
    each part's keys. Pipeline parts hold disjoint FQNs, so their dicts merge without collisions."""
    if optimizers and len(optimizers) != len(model_parts):
        raise ValueError(f"{len(model_parts)} model parts but {len(optimizers)} optimizers (one per part, or none)")
    state: dict[str, Any] = {}
    part_keys = []
    for i, part in enumerate(model_parts):
        if optimizers:
            model_sd, optim_sd = get_state_dict(part, optimizers[i], options=_OPTIONS)
        else:
            model_sd, optim_sd = get_model_state_dict(part, options=_OPTIONS), {}
        keys = [_MODEL + k for k in model_sd] + [_OPTIM + k for k in optim_sd]
        clash = next((k for k in keys if k in state), None)
        if clash is not None:
            raise ValueError(f"{clash} is in two model parts: a pipeline split must keep FQNs unique")
        state.update({_MODEL + k: v for k, v in model_sd.items()})
        state.update({_OPTIM + k: v for k, v in optim_sd.items()})
        part_keys.append(keys)
    return state, part_keys


def _optimizer_settings(state: dict[str, Any]) -> dict[str, Any]:
    """This run's optimizer settings (lr, betas, weight decay...), to put back after loading: the
    flags of the run that resumes win over the writer's, as the data-parallel jobs' schedules do.
    The state (moments, step counts) is the checkpoint's."""
    prefix = _OPTIM + "param_groups."
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items() if k.startswith(prefix)}


def _apply(
    state: dict[str, Any],
    part_keys: list[list[str]],
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """Hand each part the loaded values of its own keys (DCP loads tensors in place, but replaces
    non-tensor values such as learning rates, so the values are taken from ``state``)."""
    for i, (part, keys) in enumerate(zip(model_parts, part_keys, strict=True)):
        model_sd = {k[len(_MODEL) :]: state[k] for k in keys if k.startswith(_MODEL)}
        if optimizers:
            optim_sd = {k[len(_OPTIM) :]: state[k] for k in keys if k.startswith(_OPTIM)}
            set_state_dict(part, optimizers[i], model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
        else:
            set_model_state_dict(part, model_sd, options=_OPTIONS)


def _expectation_problem(path: Path, marker: dict, expect: Mapping[str, Any] | None) -> str | None:
    for key, wanted in (expect or {}).items():
        found = marker["extra"].get(key)
        if found != wanted:
            return (
                f"checkpoint {path} was written with {key} {found!r}, but this run has {key} {wanted!r}: "
                f"use another --checkpoint-dir, or delete {path.parent}/step-* to start from step 0"
            )
    return None


def _fit_problem(path: Path, state: dict[str, Any]) -> str | None:
    """Why the checkpoint cannot fill this rank's state dict (missing keys, other global shapes), or None."""
    try:
        saved = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # any unreadable index means the same: this checkpoint cannot be used
        return f"cannot read checkpoint {path} ({type(exc).__name__}: {exc}): delete it to resume from the one before"
    missing = [k for k in state if k not in saved.state_dict_metadata]
    reshaped = [f"{k} saved {list(s)}, here {list(h)}" for k, s, h in _shape_differences(saved, state)]
    if not missing and not reshaped:
        return None
    problems = []
    if missing:
        problems.append(f"{len(missing)} of this model's entries are not in it ({', '.join(missing[:_EXAMPLES])})")
    if reshaped:
        problems.append(f"{len(reshaped)} have another shape ({'; '.join(reshaped[:_EXAMPLES])})")
    return (
        f"checkpoint {path} does not fit this model: {' and '.join(problems)}: it belongs to another model; "
        f"use another --checkpoint-dir, or delete {path.parent}/step-* to start from step 0"
    )


def _shape_differences(saved: Metadata, state: dict[str, Any]) -> list[tuple[str, torch.Size, torch.Size]]:
    differences = []
    for key, value in state.items():
        entry = saved.state_dict_metadata.get(key)
        # A DTensor's ``shape`` is its global shape: what the checkpoint's index records.
        if (
            isinstance(value, torch.Tensor)
            and entry is not None
            and (isinstance(entry, BytesStorageMetadata) or entry.size != value.shape)
        ):
            differences.append((key, getattr(entry, "size", torch.Size()), value.shape))
    return differences


def _failures(exc: CheckpointException) -> list[BaseException]:
    return [failure[0] if isinstance(failure, tuple) else failure for _, failure in sorted(exc.failures.items())]


def _first_failure(exc: CheckpointException) -> str:
    rank, failure = min(exc.failures.items())
    inner = failure[0] if isinstance(failure, tuple) else failure
    lines = str(inner).strip().splitlines()
    return f"rank {rank}: {type(inner).__name__}: {lines[0] if lines else ''}"


def _write_json(path: Path, data: dict) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, path)
    fsync_path(path.parent)


def _discard(path: Path, directory: Path) -> None:
    """Delete a checkpoint so that no moment shows half of it under its name: hide, then delete."""
    hidden = directory / f"{_HIDDEN_PREFIX}{path.name[len('step-') :]}.old-{uuid.uuid4().hex[:12]}"
    os.rename(path, hidden)
    fsync_path(directory)
    shutil.rmtree(hidden, ignore_errors=True)


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _outcome(error: type[JobError], outcome: Outcome | None) -> Any:
    """Rank 0's outcome on every rank: its value, or ``error`` with its message raised everywhere.
    (Messages travel, not exceptions: unpickling drops ``every_rank``.)"""
    ok, value = _from_rank0(outcome)
    if not ok:
        raise error(value, every_rank=True)
    return value


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(problem: str | None) -> None:
    """Raise :class:`CheckpointRefused` on every rank if any rank found a problem (pipeline ranks
    check different keys, so verdicts can differ); the lowest rank's message is the one reported."""
    problems = [problem]
    if _distributed():
        problems = [None] * _world_size()
        dist.all_gather_object(problems, problem)
    for rank, found in enumerate(problems):
        if found is not None:
            raise CheckpointRefused(found if rank == 0 else f"rank {rank}: {found}", every_rank=True)
