"""Plain checks of the operator's inputs, for any module of the operator side: text and JSON files read
with one clear error, a pydantic error on one line, directories that can be written, tools on PATH. Each
raises OperatorError (dtrain/errors.py) with the message the user sees; nothing here knows of argparse.
Runs on the operator's machine (and in the local cluster's own processes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dtrain.errors import ExitCode, OperatorError, explain_os_error


def read_text_file(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise OperatorError(f"{what} {path} is not UTF-8 text (byte {exc.start}): is it the right file?") from None
    except OSError as exc:
        raise explain_os_error(exc, f"read the {what}") from None


def read_json_file(path: Path, what: str) -> Any:
    text = read_text_file(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise OperatorError(f"{what} {path} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    """`field.path: problem; ...; missing: a, b` on one line, without pydantic's URLs or the (secret) values."""

    def where(error: Any) -> str:
        return ".".join(str(part) for part in error["loc"]) or "the document"

    # a check of ours raises ValueError, which pydantic reports as "Value error, <our text>"
    problems = [f"{where(e)}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors() if e["type"] != "missing"]
    missing = [where(e) for e in exc.errors() if e["type"] == "missing"]
    parts = problems[:limit] + ([f"and {len(problems) - limit} more"] if len(problems) > limit else [])
    return "; ".join(parts + ([f"missing: {', '.join(missing)}"] if missing else []))


def check_directory(path: str | Path, what: str) -> Path:
    """Check that `what` is, or can be made, a writable directory at path; nothing is created."""
    path = Path(path).expanduser()
    nearest = next(p for p in (path, *path.parents) if p.exists())  # "/" or "." at the latest
    if not nearest.is_dir():
        where = "" if nearest == path else f": {nearest}"
        raise OperatorError(f"{what} {path}{where} is a file, not a directory")
    if not os.access(nearest, os.W_OK | os.X_OK):
        where = "" if nearest == path else f" ({nearest})"
        reason = "read-only file system" if os.statvfs(nearest).f_flag & os.ST_RDONLY else "permission denied"
        raise OperatorError(f"cannot write to {what} {path}{where}: {reason} (choose a writable location)")
    return path


def ensure_directory(path: str | Path, what: str) -> Path:
    """Make `what` a writable directory at path (created with its parents), or say why it cannot be."""
    path = check_directory(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise explain_os_error(exc, f"create {what}") from None
    return path


def require_tool(name: str, install_hint: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise OperatorError(f"{name} is not installed or not on PATH: {install_hint}", ExitCode.NOT_READY)
    return found
