"""Atomic, self-verifying checkpoint files; framework-neutral (payloads are bytes).

A checkpoint is ``ckpt-<step>.ckpt``: a header (magic, step, payload length, SHA-256) and the
payload. It is written to a hidden temporary file in the same directory, flushed and fsynced,
then renamed over its final name, and the directory is fsynced, so a crash at any moment
leaves either no file or a complete one. The checksum catches what atomic rename cannot
(a damaged disk, a truncated copy): loading skips such a file with a warning and falls back
to the previous checkpoint.

Only rank 0 writes; the jobs broadcast what rank 0 loaded (see :mod:`training.loop`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"HVDCKPT1"
_HEADER = struct.Struct("<8sQQ32s")  # magic, step, payload length, sha256(payload)
_NAME = re.compile(r"^ckpt-(\d{10})\.ckpt$")
_TMP_PREFIX = ".ckpt-"


class CorruptCheckpoint(Exception):
    """The file is not a complete checkpoint written by :func:`write_checkpoint`."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:010d}.ckpt"


def write_checkpoint(directory: Path, step: int, payload: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = directory / f"{_TMP_PREFIX}{step:010d}.tmp-{os.getpid()}"
    header = _HEADER.pack(MAGIC, step, len(payload), hashlib.sha256(payload).digest())
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    # Persist the rename itself; without this a power loss can forget the new name.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def read_checkpoint(path: Path) -> tuple[int, bytes]:
    """Return ``(step, payload)``; raise :class:`CorruptCheckpoint` unless the file is whole."""
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise CorruptCheckpoint(f"{path}: {len(data)} bytes, shorter than the header")
    magic, step, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{path}: not a checkpoint file (bad magic)")
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise CorruptCheckpoint(f"{path}: payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{path}: checksum mismatch")
    match = _NAME.match(path.name)
    if match and int(match.group(1)) != step:
        raise CorruptCheckpoint(f"{path}: header says step {step}")
    return step, payload


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

    def save(self, step: int, payload: bytes) -> Path:
        path = write_checkpoint(self.directory, step, payload)
        for old in self.steps()[: -self.keep]:
            checkpoint_path(self.directory, old).unlink(missing_ok=True)
        return path

    def remove_stale_temporaries(self) -> None:
        """Delete temporary files left by a writer that was killed mid-save."""
        if self.directory.is_dir():
            for tmp in self.directory.glob(f"{_TMP_PREFIX}*.tmp-*"):
                tmp.unlink(missing_ok=True)

    def load_latest(self, validate: Callable[[bytes], object]) -> tuple[int, bytes] | None:
        """``(step, payload)`` of the newest checkpoint that verifies and that ``validate``
        accepts (does not raise on), or None when there is none.

        A newest file that fails either check is reported and the previous one is tried.
        """
        for step in reversed(self.steps()):
            path = checkpoint_path(self.directory, step)
            try:
                _, payload = read_checkpoint(path)
                validate(payload)
                return step, payload
            except Exception as exc:  # any unreadable file means "try the previous one"
                log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, exc)
        return None
