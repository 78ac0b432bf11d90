"""Atomic, self-verifying checkpoint files; framework-neutral (payloads are bytes).

A checkpoint is ``ckpt-<step>.ckpt``: a header (magic, step, lengths, SHA-256), the
:class:`Fingerprint` of the model that wrote it, and the payload. It is written to a hidden
temporary file in the same directory, flushed and fsynced, then renamed over its final name,
and the directory is fsynced, so a crash at any moment leaves either no file or a complete one.
The checksum catches what atomic rename cannot (a damaged disk, a truncated copy): loading skips
such a file with a warning and falls back to an older checkpoint. The fingerprint catches a
directory that belongs to another run: that is refused, never skipped.

Only rank 0 writes; the jobs broadcast what rank 0 loaded (see :mod:`training.run.loop`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from training.errors import CheckpointRefused
from training.run.outputs import fsync_path

log = logging.getLogger(__name__)

MAGIC = b"HVDCKPT2"
OLD_MAGIC = b"HVDCKPT1"  # before fingerprints
# magic, step, fingerprint length, payload length, sha256(fingerprint + payload)
_HEADER = struct.Struct("<8sQQQ32s")
_NAME = re.compile(r"^ckpt-(\d{10})\.ckpt$")
_TMP_PREFIX = ".ckpt-"
CORRUPT_SUFFIX = ".corrupt"


class CorruptCheckpoint(Exception):
    """The file is not a complete checkpoint written by :func:`write_checkpoint`."""


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint fits: the job's framework and model, and a digest of its weights' shapes."""

    framework: str
    model: str
    num_classes: int
    shapes: str

    @classmethod
    def of(cls, framework: str, model: str, num_classes: int, shapes: Iterable[object]) -> Fingerprint:
        """``shapes``: the model's weights in order (names and shapes, or shapes alone)."""
        return cls(framework, model, num_classes, hashlib.sha256(repr(list(shapes)).encode()).hexdigest()[:16])

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Fingerprint:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise CorruptCheckpoint(f"unreadable model fingerprint ({exc})") from None

    def __str__(self) -> str:
        return f"{self.framework} {self.model} with {self.num_classes} classes (weights {self.shapes})"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    fingerprint: Fingerprint
    payload: bytes


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:010d}.ckpt"


def write_checkpoint(directory: Path, step: int, fingerprint: Fingerprint, payload: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = directory / f"{_TMP_PREFIX}{step:010d}.tmp-{os.getpid()}"
    meta = fingerprint.to_bytes()
    header = _HEADER.pack(MAGIC, step, len(meta), len(payload), hashlib.sha256(meta + payload).digest())
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(meta)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep half a checkpoint
        raise
    fsync_path(directory)  # the rename itself
    return final


def read_checkpoint(path: Path) -> Checkpoint:
    """Raise :class:`CorruptCheckpoint` unless the file is whole."""
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise CorruptCheckpoint(f"{len(data)} bytes, shorter than the header")
    magic, step, meta_length, payload_length, digest = _HEADER.unpack_from(data)
    if magic == OLD_MAGIC:
        raise CorruptCheckpoint("written by an older version of these jobs, without a model fingerprint")
    if magic != MAGIC:
        raise CorruptCheckpoint("not a checkpoint file (bad magic)")
    body = data[_HEADER.size :]
    if len(body) != meta_length + payload_length:
        raise CorruptCheckpoint(f"{len(body)} bytes after the header, the header says {meta_length + payload_length}")
    if hashlib.sha256(body).digest() != digest:
        raise CorruptCheckpoint("checksum mismatch")
    match = _NAME.match(path.name)
    if match and int(match.group(1)) != step:
        raise CorruptCheckpoint(f"the header says step {step}")
    return Checkpoint(path, step, Fingerprint.from_bytes(body[:meta_length]), body[meta_length:])


class CheckpointDir:
    """The checkpoints of one run: save with pruning, and load the newest valid one."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = directory
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps of the checkpoint files present, oldest first (validity not checked)."""
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, step: int, fingerprint: Fingerprint, payload: bytes) -> Path:
        path = write_checkpoint(self.directory, step, fingerprint, payload)
        for old in self.steps()[: -self.keep]:
            checkpoint_path(self.directory, old).unlink(missing_ok=True)
        return path

    def remove_stale_temporaries(self) -> None:
        """Delete temporary files left by a writer that was killed mid-save."""
        if self.directory.is_dir():
            for tmp in self.directory.glob(f"{_TMP_PREFIX}*.tmp-*"):
                tmp.unlink(missing_ok=True)

    def load_latest(
        self, expected: Fingerprint, decode: Callable[[bytes], object], ignore_bad: bool = False
    ) -> Checkpoint | None:
        """The newest checkpoint that verifies and that ``decode`` accepts (does not raise on),
        or None when the directory holds none.

        Damaged files newer than that one are reported and skipped. If every file is damaged,
        :class:`CheckpointRefused`, unless ``ignore_bad``: then they are renamed to
        ``*.corrupt`` (so they cannot shadow the new run's checkpoints) and the run starts
        fresh. A checkpoint of another model or framework is refused, never skipped: its
        directory belongs to another run.
        """
        unusable: list[tuple[Path, str]] = []
        for step in reversed(self.steps()):
            path = checkpoint_path(self.directory, step)
            try:
                checkpoint = read_checkpoint(path)
                self._refuse_unless_fits(checkpoint, expected)
                decode(checkpoint.payload)
            except CheckpointRefused:
                raise
            except Exception as exc:  # any unreadable file means "try the one before"
                unusable.append((path, str(exc)))
                continue
            for bad, reason in unusable:
                log.warning("checkpoint %s is unusable (%s); falling back to the older %s", bad, reason, path)
            return checkpoint
        if unusable:
            self._give_up_on(unusable, ignore_bad)
        return None

    def _refuse_unless_fits(self, checkpoint: Checkpoint, expected: Fingerprint) -> None:
        if checkpoint.fingerprint != expected:
            raise CheckpointRefused(
                f"checkpoint {checkpoint.path} holds {checkpoint.fingerprint}, but this run is {expected}: "
                f"use another --checkpoint-dir, or delete {self.directory}/ckpt-*.ckpt to start from step 0"
            )

    def _give_up_on(self, unusable: list[tuple[Path, str]], ignore_bad: bool) -> None:
        problems = "; ".join(f"{path.name}: {reason}" for path, reason in unusable)
        if not ignore_bad:
            raise CheckpointRefused(
                f"no usable checkpoint in {self.directory} ({problems}): delete the damaged files, use "
                "another --checkpoint-dir, or pass --ignore-bad-checkpoints to start from step 0"
            )
        for path, _ in unusable:
            path.rename(path.with_name(path.name + CORRUPT_SUFFIX))
        log.warning(
            "no usable checkpoint in %s (%s); --ignore-bad-checkpoints: renamed them to *%s, starting from step 0",
            self.directory,
            problems,
            CORRUPT_SUFFIX,
        )
