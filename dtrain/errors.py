"""The errors the CLIs turn into a clear message; their exit statuses come from the product's one table,
training/exit_status.py (re-exported here as ``ExitCode``), which the training jobs exit with too, so a
launch that passes a job's status through keeps its meaning. dtrain/remote/boot/blob_pull.py repeats the
numbers because it must stand alone (stdlib only).
"""

from __future__ import annotations

import errno

from training.exit_status import ExitCode

__all__ = ["ExitCode", "OperatorError", "explain_os_error"]


class OperatorError(Exception):
    """A failure the operator can act on. The message is printed as-is; exit_code is returned."""

    def __init__(self, message: str, exit_code: int = ExitCode.BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


# errno -> (what happened, what to do). ENOSPC/EDQUOT are the machine's state, not the input.
_OS_ERRORS: dict[int, tuple[str, str]] = {
    errno.ENOENT: ("it does not exist", "check the path"),
    errno.EACCES: ("permission denied", "check its permissions or choose another path"),
    errno.EPERM: ("operation not permitted", "check its permissions or choose another path"),
    errno.EROFS: ("read-only file system", "choose a writable location"),
    errno.EISDIR: ("it is a directory", "pass a file"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "check the path"),
    errno.EEXIST: ("it already exists", "choose another path"),
    errno.ENAMETOOLONG: ("the name is too long", "choose a shorter path"),
    errno.ENOSPC: ("no space left on the device", "free some space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free some space"),
}


def explain_os_error(exc: OSError, action: str) -> OperatorError:
    """'cannot <action> <path>: <what happened> (<what to do>)' for an OSError from a file operation."""
    reason, advice = _OS_ERRORS.get(exc.errno or 0, ((exc.strerror or str(exc)).lower(), "check the path"))
    code = ExitCode.NOT_READY if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ExitCode.BAD_INPUT
    path = f" {exc.filename}" if exc.filename is not None else ""
    return OperatorError(f"cannot {action}{path}: {reason} ({advice})", code)
