"""Refuse a per-rank launch of a command that starts its own launcher. Runs on the operator's machine.

In per-rank mode (`launch --workdir`'s default) the command runs on every rank under our torchrun or
horovodrun. A command that is itself a launcher (`torchrun --nproc-per-node 2 train.py`) would start a
launcher per rank: every worker a world of its own, N unsynchronised models, and a job that ends "ok".
So such a command is refused before anything is sent, with the mode that runs it as written.

What counts as a launcher: the first word of the command, or of any command in a `sh|bash -c SCRIPT`
(after `;`, `&&`, `||`, `|`, past `VAR=value` assignments and `env`/`exec`/`nohup`): torchrun,
`python -m torch.distributed.run|launch`, `accelerate launch`, deepspeed, and the MPI-style launchers
(horovodrun, mpirun, mpiexec), which start every rank from one node.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from dtrain.errors import OperatorError

PER_NODE_LAUNCHERS = ("torchrun", "deepspeed", "accelerate launch", "python -m torch.distributed.run")
ONE_NODE_LAUNCHERS = ("horovodrun", "mpirun", "mpiexec")  # they start every rank themselves
_PYTHON = re.compile(r"python(3(\.\d+)?)?")
_SEPARATORS = (";", "&&", "||", "|", "&")
_PREFIXES = ("env", "exec", "nohup", "time")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def launcher_in(command: Sequence[str]) -> str | None:
    """The launcher the command starts (as the user would name it), or None."""
    words = list(command)
    if len(words) >= 3 and words[0].rsplit("/", 1)[-1] in ("sh", "bash") and words[1] == "-c":
        try:
            script = shlex.split(words[2], comments=True)
        except ValueError:  # unbalanced quotes: the shell will say so
            return None
        return next(filter(None, (_launcher_at(part) for part in _commands(script))), None)
    return _launcher_at(words)


def _commands(words: list[str]) -> list[list[str]]:
    """A shell script's words split into its simple commands (shlex keeps `a;` as one word: split it)."""
    commands: list[list[str]] = [[]]
    for word in words:
        for separator in _SEPARATORS:
            if word.endswith(separator) and word != separator:
                commands[-1].append(word[: -len(separator)])
                word = separator
                break
        if word in _SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    return commands


def _launcher_at(words: Sequence[str]) -> str | None:
    rest = list(words)
    # `env -i A=1 torchrun ...`: past the prefix commands, their flags and the assignments
    while rest and (rest[0] in _PREFIXES or _ASSIGNMENT.match(rest[0]) or rest[0].startswith("-")):
        rest = rest[1:]
    if not rest:
        return None
    program = rest[0].rsplit("/", 1)[-1]
    if program in ("torchrun", "deepspeed", *ONE_NODE_LAUNCHERS):
        return program
    if program == "accelerate" and rest[1:2] == ["launch"]:
        return "accelerate launch"
    if _PYTHON.fullmatch(program) and len(rest) >= 3 and rest[1] == "-m":
        if rest[2] in ("torch.distributed.run", "torch.distributed.launch"):
            return f"python -m {rest[2]}"
        if rest[2] in ("deepspeed", "deepspeed.launcher.runner"):
            return "deepspeed"
    return None


def check_launcher_mode(command: Sequence[str], mode: str, flag_mode: str) -> None:
    """One `error:` line when the command's own launcher cannot run in the chosen mode (flag_mode: how
    the user sets the mode, e.g. '--mode per-node (task file: mode: per-node)')."""
    launcher = launcher_in(command)
    if launcher is None:
        return
    if launcher in ONE_NODE_LAUNCHERS:
        raise OperatorError(
            f"the command starts {launcher}, which starts every rank itself: leave {launcher} out of the command "
            "and pass --launcher horovodrun (one horovodrun for the whole job, across the allocation)"
        )
    if mode == "per-rank":
        raise OperatorError(
            f"the command starts its own launcher ({launcher}): per rank, each would start a world of its own; "
            f"run it once per node with {flag_mode}, or leave {launcher} out and let launch start the ranks"
        )
