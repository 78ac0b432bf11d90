"""Rich consoles that stay readable when the output is a log file or a CI pipe (not a terminal)."""

from __future__ import annotations

import os
import sys

from rich.console import Console


def make_console(stderr: bool = True) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 150
    return Console(stderr=stderr, width=width)
