"""Rank 0 writes its checkpoints beside training: the other ranks never wait for the file system.

A save's bytes are taken at its step, in the training thread (a copy in memory). Writing them to a
shared file system at under 1 GB/s takes minutes for a large model, far past the peer timeout that
bounds every collective (training/world/distributed.py), and the other ranks would wait for it in their
next collective and fail a healthy job. So one thread writes the files. Rank 0 waits for a write
only up to half the peer timeout (what its peers can afford to wait for it): a save that fits is done
when training goes on, as before; a longer one goes on beside training. A save that comes due while
an earlier one is still being written takes the place of any save still waiting (the newest state
wins; no more than one write and one waiting copy in memory), and the job waits for the last write
only once its backend is down, when no peer is waiting any more (:func:`finish_writes`, which
training/run/job.py calls).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from training.checkpoint.files import CheckpointDir, Fingerprint
from training.run.outputs import output_error

log = logging.getLogger(__name__)
_open_writers: list[CheckpointWriter] = []


def finish_writes() -> None:
    """Wait for every writer's last checkpoint (after the backend has shut down); raises if one failed."""
    while _open_writers:
        _open_writers.pop().close()


class CheckpointWriter:
    """The checkpoints of one run, written by a thread of their own, one at a time."""

    def __init__(self, checkpoints: CheckpointDir, fingerprint: Fingerprint) -> None:
        self._checkpoints, self._fingerprint = checkpoints, fingerprint
        self._ready = threading.Condition()
        self._waiting: tuple[int, bytes] | None = None
        self._closing = False
        self._failure: OSError | None = None
        self._written = -1  # the step of the last checkpoint written
        self._thread = threading.Thread(target=self._write_all, name="checkpoint-writer", daemon=True)
        self._thread.start()
        _open_writers.append(self)

    def submit(self, step: int, payload: bytes, wait_s: float) -> None:
        """Queue step's checkpoint and wait up to wait_s for it to be written; raises if a write failed."""
        self._raise_failure()
        with self._ready:
            if self._waiting is not None:
                log.warning("checkpoint of step %d not written: step %d's replaces it", self._waiting[0], step)
            self._waiting = (step, payload)
            self._ready.notify_all()
            written = self._ready.wait_for(lambda: self._written >= step or self._failure is not None, wait_s)
        self._raise_failure()
        if not written:
            log.info("checkpoint of step %d is still being written; training goes on", step)

    def close(self) -> None:
        """Wait for the last checkpoint to be written; raises if a write failed."""
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        self._thread.join()
        self._raise_failure()

    def _write_all(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._waiting is not None or self._closing)
                if self._waiting is None:
                    return
                step, payload = self._waiting
                self._waiting = None
            try:
                path = self._checkpoints.save(step, self._fingerprint, payload)
            except OSError as exc:
                with self._ready:
                    self._failure = exc
                    self._ready.notify_all()
                return
            log.info("saved checkpoint %s", path)
            with self._ready:
                self._written = step
                self._ready.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            # said once: a writer whose failure ended its run is no longer open, so that finish_writes (at the
            # end of the next run in this process) does not raise it again for that run
            if self in _open_writers:
                _open_writers.remove(self)
            raise output_error("--checkpoint-dir", Path(self._checkpoints.directory), self._failure) from None
