#!/usr/bin/env python3
"""job-secrets: a run's secrets file (a task file's `secrets`), and the mask that keeps its values out
of the job's logs. Standard library only: the operator's `launch` writes the file with this module, the
batch script runs it on the nodes with their python3, from the run's `remote/` directory:

  srun ... setup_once.py ... 2>&1 | python3 job_secrets.py RUN/secrets/env   # setup's lines, masked

The file, RUN/secrets/env, is `NAME='value'` words as POSIX sh quotes them, which the wrapper around the
user's command sources (`set -a; . FILE`; dtrain/jobs/task_steps.py). Our tools read it as one text, not
line by line: a quoted value may hold newlines, quotes, backslashes, any Unicode, and bytes that are not
UTF-8 (they are kept as the operator's environment had them).

The mask replaces every occurrence of a value with `***`, as CI systems mask their secrets (GitHub
Actions' add-mask): the whole value, and each line of a multi-line value on its own (a log is read line
by line, so a printed multi-line value arrives one line at a time), each line stripped of the blanks
around it; blank lines are not masked. It works on bytes, a line at a time: what it cannot see is a
transformed value (base64, split across lines or writes, reversed, URL-encoded: docs/operator.md).

As a command it copies standard input to standard output line by line, masked, flushed after each
line; a last line without a newline is masked at end of input. SIGINT and SIGTERM are ignored, as
annotate_output.py ignores them: on scancel the log keeps the last lines of what it reads.
Exit status: 0; 2 bad arguments. A secrets file that is missing or unreadable masks nothing: its values
are then nowhere on the node for the user's command to print.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
from collections.abc import Iterable
from typing import BinaryIO

MASK = b"***"
# how the operator's environment and the file hold bytes that are not UTF-8 (os.environ's own way)
ENCODING, ERRORS = "utf-8", "surrogateescape"


def render_secrets(values: dict[str, str]) -> bytes:
    """The secrets file: one `NAME='value'` word per secret, as sh sources it."""
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items()).encode(ENCODING, ERRORS)


def parse_secrets(text: bytes) -> dict[str, str]:
    """The secrets of a file that render_secrets wrote: its words as sh reads them, across lines."""
    words = shlex.split(text.decode(ENCODING, ERRORS))
    return dict(word.split("=", 1) for word in words)


def read_secrets(path: str) -> dict[str, str]:
    """The secrets in the file at path; none where it cannot be read (removed at the job's end) or is
    not one that render_secrets wrote (cut short: sh cannot source it either, so no command has them)."""
    try:
        with open(path, "rb") as handle:
            return parse_secrets(handle.read())
    except (OSError, ValueError):
        return {}


def masked_pieces(value: str) -> set[bytes]:
    """What to mask for one value: the whole, and each line of it, stripped; never blank text."""
    whole = value.encode(ENCODING, ERRORS)
    pieces = {whole, *(line.strip() for line in whole.splitlines())}
    return {piece for piece in pieces if piece.strip()}


class SecretMask:
    """Replaces the secrets' values (and their lines) with `***` in a line of bytes. One regular
    expression, longest alternative first, so that a value that holds another is masked whole."""

    def __init__(self, values: Iterable[str]) -> None:
        pieces = sorted({piece for value in values for piece in masked_pieces(value)}, key=len, reverse=True)
        self._pattern = re.compile(b"|".join(map(re.escape, pieces))) if pieces else None

    def __call__(self, line: bytes) -> bytes:
        return self._pattern.sub(MASK, line) if self._pattern else line


def copy_masked(source: BinaryIO, sink: BinaryIO, mask: SecretMask) -> None:
    for line in source:
        sink.write(mask(line))
        sink.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="job_secrets.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("secrets_file", help="the run's secrets file (RUN/secrets/env)")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    copy_masked(sys.stdin.buffer, sys.stdout.buffer, SecretMask(read_secrets(args.secrets_file).values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
