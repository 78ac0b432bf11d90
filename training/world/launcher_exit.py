"""horovodrun and torchrun, run unchanged in this process, ending with the failed worker's status.

Both launchers end a job whose worker failed by raising: horovodrun a RuntimeError that names the
first process to fail and its exit code, torchrun (behind its `@record`) a ChildFailedError with
every failure. Python then prints a 25-line traceback of the launcher's own frames after the
worker's `error:` line and exits 1, whatever the worker's status was: bad input (2) reads as a
failed job (1). `python -m training.horovodrun` and `python -m training.torchrun` take exactly the
launchers' arguments; a worker's failure becomes the exit status of the first worker to fail (a
signal N as 128 + N, as a shell reports it), with no traceback: the worker has said what was
wrong, or, if a signal ended it, one `error:` line here says which. A launcher that refuses its own
arguments (a ValueError or an assertion, e.g. `--nproc-per-node 0`) is one `error:` line and exit 2; a
worker command that does not exist or cannot be executed is one `error:` line and 127 or 126, as in a shell.
`--debug` among the worker's flags keeps the launchers' tracebacks and logs. Anything else the
launcher raises is its own bug and goes out as it would.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
from collections.abc import Callable, Sequence

from training.errors import ExitCode, first_line

# horovod 0.28.1 (the last release), horovod/runner/gloo_run.py: launch_gloo's message.
_HOROVOD_FIRST_FAILURE = re.compile(r"Process name: (\S+)\s+Exit code: (-?\d+)")
ELASTIC_LOGGERS = "torch.distributed.elastic"
# A shell's statuses for a command it cannot find or cannot execute: what `--no-python nosuchprog` gets.
COMMAND_NOT_FOUND, COMMAND_NOT_EXECUTABLE = 127, 126


def exit_status(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal N (-N from the launchers) is 128 + N."""
    return 128 - code if code < 0 else code


def report(who: str, code: int) -> int:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        print(f"error: {who} was killed by {name}", file=sys.stderr, flush=True)
    return exit_status(code)


def debugging(argv: Sequence[str]) -> bool:
    return "--debug" in argv


def run_horovodrun(argv: Sequence[str]) -> int:
    from horovod.runner.launch import run_commandline

    return _run(["horovodrun", *argv], run_commandline, horovod_first_failure, debugging(argv))


def horovod_first_failure(exc: BaseException) -> tuple[str, int] | None:
    found = _HOROVOD_FIRST_FAILURE.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return (f"process {found[1]}", int(found[2])) if found else None


def run_torchrun(argv: Sequence[str]) -> int:
    from torch.distributed.run import main

    if not debugging(argv):
        # the elastic agent's warnings and its "failed (exitcode: N)" line repeat what the worker said
        for name in [ELASTIC_LOGGERS, *logging.root.manager.loggerDict]:
            if name.startswith(ELASTIC_LOGGERS):
                logging.getLogger(name).setLevel(logging.CRITICAL)

    return _run(["torchrun", *argv], lambda: main(list(argv)), torchrun_first_failure, debugging(argv))


def torchrun_first_failure(exc: BaseException) -> tuple[str, int] | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(exc, ChildFailedError):
        return None
    rank, failure = exc.get_first_failure()
    return f"rank {rank}", failure.exitcode


def _run(
    argv0: list[str],
    launch: Callable[[], object],
    worker_failure: Callable[[BaseException], tuple[str, int] | None],
    debug: bool,
) -> int:
    sys.argv = argv0
    try:
        launch()
    except Exception as exc:
        if debug:
            raise
        failed = worker_failure(exc)
        if failed is not None:
            return report(*failed)
        if isinstance(exc, FileNotFoundError | PermissionError) and exc.filename:  # the worker's command
            print(f"error: {argv0[0]}: cannot run {exc.filename}: {exc.strerror}", file=sys.stderr, flush=True)
            return COMMAND_NOT_FOUND if isinstance(exc, FileNotFoundError) else COMMAND_NOT_EXECUTABLE
        if isinstance(exc, ValueError | AssertionError):  # the launcher refused its own arguments
            why = first_line(exc) if str(exc).strip() else "its arguments do not fit together (--debug shows where)"
            print(f"error: {argv0[0]}: {why}", file=sys.stderr, flush=True)
            return ExitCode.BAD_INPUT
        raise
    return ExitCode.OK
