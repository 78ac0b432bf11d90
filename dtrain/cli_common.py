"""What every operator CLI shares: the parser (--debug on every command, the exit-status table in
--help), argparse validators, checks of input files, directories and tools, and `run_cli`, the one
path every error takes to the terminal: `error: <message>` on stderr and a status from
`ExitCode` (under --json also the error document on stdout), with a traceback only under --debug (or
SCRIPTS_DEBUG=1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError

from dtrain.errors import ExitCode, OperatorError, explain_os_error
from dtrain.json_documents import ErrorDocument, Failure

DEBUG_ENV = "SCRIPTS_DEBUG"
DEBUG_HINT = "(run again with --debug for the traceback)"
EXIT_STATUS_HELP = (
    "Exit status: 0 ok; 1 the job or a remote step failed (or an internal error); 2 bad input; "
    "3 environment not ready (tool missing, unreachable, access refused); 4 timed out; 130 interrupted."
)
T = TypeVar("T")


class UsageError(SystemExit):
    """A bad command line, as argparse ends on it (exit 2), with the message kept for `--json`."""

    def __init__(self, message: str):
        super().__init__(ExitCode.BAD_INPUT)
        self.message = message


class CLIParser(argparse.ArgumentParser):
    """argparse with --debug on every (sub)command, the exit-status table in --help, and usage
    errors printed as `error: ...` like every other error (exit 2)."""

    def __init__(self, *args: Any, epilog: str | None = None, **kwargs: Any):
        # allow_abbrev=False: a flag is taken only as spelled in full, never as a guess at a longer one.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, epilog="\n\n".join(filter(None, (epilog, EXIT_STATUS_HELP))), **kwargs)
        # SUPPRESS: a subcommand's parser must not reset a --debug given before the subcommand
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise UsageError(message)


CLUSTER_HELP = "cluster description file (default: $CLUSTER_DESCRIPTION, else the local cluster's)"


def add_cluster_option(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    """--cluster, the one flag every cluster command shares. It is taken before the command
    (`python -m dtrain --cluster F jobs`) or after it (`... jobs --cluster F`); SUPPRESS keeps a
    command's parser from resetting the value given before it."""
    parser.add_argument(
        "--cluster",
        type=non_empty,
        default=None if top_level else argparse.SUPPRESS,
        metavar="FILE",
        help=CLUSTER_HELP,
    )


def debugging(args: argparse.Namespace | None) -> bool:
    """--debug was given (args), or SCRIPTS_DEBUG is set: show tracebacks."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0") or bool(getattr(args, "debug", False))


def run_cli(
    parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None
) -> int:
    """Parse argv and run body; every failure becomes `error: ...` on stderr and its exit status, and
    under --json also an error document on stdout (dtrain/json_documents.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = debugging(None)
    # until the command line is parsed, --json is what it says before `--` (after it: a job's own words)
    as_json = "--json" in argv[: argv.index("--") if "--" in argv else len(argv)]
    try:
        args = parser.parse_args(argv)
        debug, as_json = debugging(args), bool(getattr(args, "json", False))
        return int(body(args))
    except UsageError as exc:
        if as_json:
            _error_document(exc.message, int(exc.code or 0))
        raise
    except OperatorError as exc:
        return _report(str(exc), exc.exit_code, debug, as_json)
    except KeyboardInterrupt:
        return _report("interrupted", ExitCode.INTERRUPTED, debug, as_json)
    except BrokenPipeError:
        # The reader went away (`... | head`): say nothing more, and keep Python from printing
        # its own complaint when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(ExitCode.FAILED)
    except Exception as exc:  # the safety net: whatever slipped past the checks gets a message too
        message, code = _describe_unexpected(exc)
        return _report(message if debug else f"{message} {DEBUG_HINT}", code, debug, as_json)


def end_on_termination() -> None:
    """SIGTERM and SIGHUP (a kill, a closed terminal) end the command the way an exception does, so
    that what it holds is released on the way out: the private SSH configuration under /tmp, a shared
    connection. A followed job runs on, as on a detach. Python's default would exit on the spot.
    For the operator's commands only: the local cluster's daemons keep the default."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set there (a test calling run_cli from a thread)

    def end(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, end)


def _report(message: str, code: int, debug: bool, as_json: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        _error_document(message, int(code))
    return int(code)


def _error_document(message: str, code: int) -> None:
    ErrorDocument(error=Failure(message=message, exit_status=code)).print()


def _describe_unexpected(exc: Exception) -> tuple[str, int]:
    if isinstance(exc, OSError) and exc.filename is not None:
        err = explain_os_error(exc, "use")
        return str(err), err.exit_code
    return f"unexpected {type(exc).__name__}: {exc}", ExitCode.FAILED


# --- argparse types: argparse reports a bad value as a usage error (exit 2) --------------------
def int_between(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be a whole number {bounds}, got {text!r}")
        return value

    return whole_number


def _number(text: str, accept: Callable[[float], bool], requirement: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and accept(value)):
        raise argparse.ArgumentTypeError(f"must be a number {requirement}, got {text!r}")
    return value


def positive_number(text: str) -> float:
    return _number(text, lambda value: value > 0, "> 0")


def non_negative_number(text: str) -> float:
    return _number(text, lambda value: value >= 0, ">= 0")


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def arg_type(check: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a check that raises OperatorError: a flag and the library function
    behind it share one check, and argparse reports a bad value as a usage error."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except OperatorError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = check.__name__
    return parse


# --- inputs on disk and tools on PATH ----------------------------------------------------------
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
