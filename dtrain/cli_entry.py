"""The CLI's entry helpers: the parser (--debug on every command, the exit-status table in --help),
argparse types, --cluster, and `run_cli`, the one path every error takes to the terminal: `error: <message>`
on stderr and a status from `ExitCode` (under --json also the error document on stdout), with a traceback
only under --debug (or SCRIPTS_DEBUG=1). Runs on the operator's machine.

Imported by the verbs (dtrain/cli/) and dtrain/__main__.py, and by the `main` of the local cluster's own
programs, which are commands too (tests/test_layout.py names them); the rest of the operator side raises
OperatorError and leaves the command line to these (plain checks of inputs: dtrain/checks.py).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

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
