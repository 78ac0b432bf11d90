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
_TRACEBACK = "Traceback (most recent call last):"


def without_launcher_tracebacks(echo: Callable[[str], None]) -> Callable[[str], None]:
    """echo, except for the lines of a launcher from its traceback on."""
    raised: set[str] = set()

    def show(line: str) -> None:
        launcher = _LAUNCHER_LINE.match(line.rstrip("\n"))
        if launcher is not None:
            if launcher[2].startswith(_TRACEBACK):
                raised.add(launcher[1])
            if launcher[1] in raised:
                return
        echo(line)

    return show
