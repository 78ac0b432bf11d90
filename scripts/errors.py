"""The one exception type the CLIs turn into a clear message and a non-zero exit."""

from __future__ import annotations

import sys
from collections.abc import Callable


class OperatorError(Exception):
    """A failure the operator can act on. The message is printed as-is; exit_code is returned."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def run_cli(main: Callable[[], int]) -> int:
    """Run a CLI body: OperatorError -> 'error: ...' on stderr and its exit code; Ctrl-C -> 130."""
    try:
        return main()
    except OperatorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
