"""A rank's helper processes end with it, however it ends (SIGKILL, a launcher's SIGTERM, a crash).

The DataLoader's decode workers are started through the forkserver, so their parent is the
forkserver, not the rank. torch's watchdog in a worker checks only that its parent lives, and the
forkserver outlives the rank: it stays until every holder of its "alive" pipe is gone, and each
worker it started holds one. A rank that dies without its clean-up thus leaves both behind for
ever, holding the launcher's output pipe open (horovodrun then never returns) and hundreds of
megabytes on the node. So each worker watches the rank itself, through a pidfd (Linux 5.3+): the
kernel wakes it the moment the rank ends, and it ends too; the forkserver follows, its pipe closed.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

POLL_SECONDS = 1.0  # kernels without pidfd_open: how often to look for the owner instead


def die_with(owner_pid: int) -> None:
    """End this process (SIGKILL: it holds nothing worth saving) as soon as ``owner_pid`` ends."""
    try:
        pidfd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        _die()
    except OSError:  # no pidfd_open (ENOSYS): look now and then
        threading.Thread(target=_poll, args=(owner_pid,), name="owner-watch", daemon=True).start()
        return
    threading.Thread(target=_wait, args=(pidfd,), name="owner-watch", daemon=True).start()


def _wait(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has ended
    _die()


def _poll(owner_pid: int) -> None:
    while True:
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            _die()
        time.sleep(POLL_SECONDS)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
