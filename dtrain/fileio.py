"""Files written whole or not at all, and their MD5.

A reader (another tool, a node, a rerun after Ctrl-C) sees either the old file or the complete new
one: the content goes to a temporary file beside it, which then replaces the target in one rename.
dtrain/remote/boot/blob_pull.py keeps its own copies of both: it runs alone on the NFS server (stdlib only).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1024 * 1024


@contextlib.contextmanager
def atomic_path(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary path beside `path` to write; it replaces `path` when the block ends without an
    error, and is removed otherwise."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)  # before any content lands: a secret is never readable by others
        os.close(fd)
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    with atomic_path(path, mode) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def file_md5(path: Path) -> bytes:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.digest()
