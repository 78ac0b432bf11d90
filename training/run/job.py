"""How every job starts and ends: flags, the check of its outputs, the backend, one exit status.

The three jobs give :func:`run_job` a way to start their backend and a way to train; it turns
whatever happens into one ``error:`` line and the exit status of :mod:`training.errors`.

Every job leaves through ``os._exit``, after flushing its logs, once its backend has shut down
(or failed). The alternative, releasing every collective's work object and joining every
backend thread before Python finalizes, cannot be made to hold: the last references to a
gloo ``Work`` sit inside torch (DDP's reducer, the object collectives, the process-group
registry), and a gloo worker thread that drops one during finalization needs the GIL, exits,
and ``std::terminate`` aborts a run that had already finished (upstream's race: a few DDP runs
in a hundred). tf.data's iterator destructors can hang at exit the same way. With ``os._exit``
nothing runs after the metrics are written and the backend is down. Of the ``atexit`` handlers
skipped, one matters: the DataLoader's shutdown of its workers. Workers started through the
forkserver watch the forkserver, not the job, so the job stops its own descendants before it
leaves (:func:`_stop_descendants`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import psutil

from training.checkpoint.writer import finish_writes
from training.config.settings import TrainingSettings, parse_settings
from training.errors import BadInput, ExitCode, JobError, first_line
from training.run import tracking
from training.run.loop import configure_logging
from training.run.outputs import check_output_paths
from training.world import preemption
from training.world.distributed import QUIET_RANK_DELAY_SECONDS, Backend, launcher_rank, peer_timeout_seconds
from training.world.liveness import Liveness

B = TypeVar("B", bound=Backend)


def run_job(
    framework: str,
    argv: Sequence[str] | None,
    start: Callable[[TrainingSettings], B],
    train: Callable[[TrainingSettings, B], object],
    parse: Callable[[Sequence[str] | None], TrainingSettings] | None = None,
) -> NoReturn:
    """Parse the flags, check the outputs, start the backend, train, and exit with the table's status.

    ``parse``: the framework's parser under another command's name (training.model_parallel's, whose
    errors name its torchrun line); default: :func:`training.config.settings.parse_settings`.
    """
    settings = parse(argv) if parse is not None else parse_settings(framework, argv)  # a bad flag exits 2 here
    configure_logging(launcher_rank())
    preemption.install()  # a Spot eviction: checkpoint at the next step boundary, exit PREEMPTED
    _exit(_run(settings, start, train))


def _run(
    settings: TrainingSettings, start: Callable[[TrainingSettings], B], train: Callable[[TrainingSettings, B], object]
) -> int:
    backend: B | None = None
    liveness: Liveness | None = None
    try:
        if launcher_rank() == 0:
            check_output_paths(settings)
            tracking.start(settings)  # MLflow, when the job's environment names a run
        backend = start(settings)
        liveness = Liveness(backend)
        result = train(settings, backend)
        tracking.finish(settings, result)  # a bounded wait, however the server is
        backend.shutdown()
        finish_writes()  # rank 0's last checkpoint: no peer waits for it any more
        return ExitCode.OK
    except BaseException as exc:  # every way out becomes one line and one exit status
        return _report(exc, settings.debug, backend, liveness)


def _report(exc: BaseException, debug: bool, backend: Backend | None, liveness: Liveness | None) -> int:
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, KeyboardInterrupt):
        _print_error("interrupted")
        return ExitCode.INTERRUPTED
    if isinstance(exc, JobError):
        # Bad input (a broken data directory) is usually every rank's: rank 0 reports it, and the
        # launcher stops the others while they wait, so that the log holds one error line.
        rank = backend.rank if backend is not None else launcher_rank()  # met before the backend started
        quiet = rank != 0 and (exc.every_rank or isinstance(exc, BadInput))
        if quiet:
            time.sleep(QUIET_RANK_DELAY_SECONDS)
        if not (quiet and exc.every_rank):
            _print_error(str(exc))
        return exc.exit_code
    # A collective failed, or something unexpected: is a peer frozen, cut off or gone?
    waited = peer_timeout_seconds(backend.backend) if backend is not None else None
    troubled = liveness.troubled_peers(waited=waited) if liveness is not None else {}
    if liveness is not None and troubled:
        culprits = "; ".join(f"{peer} {problem}" for peer, problem in troubled.items())
        _print_error(f"{culprits}; {liveness.me} noticed: {first_line(exc)}")
        return ExitCode.FAILED
    if backend is not None and isinstance(exc, backend.failures):
        _print_error(first_line(exc))
    else:
        if not debug:  # a bug: its traceback is the report
            traceback.print_exception(exc)
        _print_error(f"{type(exc).__name__}: {first_line(exc)}")
    return ExitCode.FAILED


def _print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _stop_descendants(grace_s: float = 5.0) -> None:
    """SIGKILL every process this one started (decode workers, the forkserver): they hold no
    state worth saving, and left alone they would outlive the job."""
    descendants = psutil.Process().children(recursive=True)
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(descendants, timeout=grace_s)


def _exit(code: int) -> NoReturn:
    _stop_descendants()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # what the frameworks' C++ code left in stdio buffers
    os._exit(code)
