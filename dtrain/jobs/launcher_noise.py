"""Keep a launcher's own traceback off the console while a job is followed.

horovodrun and torchrun end a job whose worker failed by raising, so the run's log ends with a
25-line traceback of the launcher (`[horovodrun] Traceback ...`, `[torchrun@node-0] Traceback ...`),
even when the worker refused bad input in one `error:` line. The log keeps it (the verdict is read
from its closing summary, and it is evidence); what `launch` shows hides it: from a launcher's
`Traceback` line to that launcher's last line, since a launcher that raised has nothing more to say.
The failed rank and its message are what `launch` prints after the job ends. `--debug` shows all.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# dtrain/remote/job/annotate_output.py's prefix of a launcher's own line: [horovodrun], [torchrun@node-1]
_LAUNCHER_LINE = re.compile(r"^(\[(?:horovodrun|torchrun)(?:@[^\]]+)?\]) ?(.*)$")
# A traceback that torch's elastic agent logs instead of raising (while it stops at a SIGTERM, for
# example): every line of it carries the same logging header, `E1127 21:37:22.981000 55 file.py:154] `.
_LOGGED = re.compile(r"^([EWIF]\d{4} [\d:.]+ +\d+ \S+:\d+\] )(.*)$")
_TRACEBACK = "Traceback (most recent call last):"


def without_launcher_tracebacks(echo: Callable[[str], None]) -> Callable[[str], None]:
    """echo, except for the lines of a launcher from its traceback on, and the lines of a traceback a
    launcher logged (those with that traceback's logging header)."""
    raised: set[str] = set()
    logged: set[tuple[str, str]] = set()  # (launcher, logging header) of a logged traceback

    def show(line: str) -> None:
        launcher = _LAUNCHER_LINE.match(line.rstrip("\n"))
        if launcher is not None:
            who, text = launcher[1], launcher[2]
            if text.startswith(_TRACEBACK):
                raised.add(who)
            header = _LOGGED.match(text)
            if header is not None and header[2].startswith(_TRACEBACK):
                logged.add((who, header[1]))
            if who in raised or (header is not None and (who, header[1]) in logged):
                return
        echo(line)

    return show
