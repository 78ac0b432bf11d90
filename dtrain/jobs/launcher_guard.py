"""Refuse a per-rank launch of a command that starts its own launcher. Runs on the operator's machine.

In per-rank mode (`launch --workdir`'s default) the command runs on every rank under our torchrun or
horovodrun. A command that is itself a launcher (`torchrun --nproc-per-node 2 train.py`) would start a
launcher per rank: every worker a world of its own, N unsynchronised models, and a job that ends "ok".
So such a command is refused before anything is sent, with the mode that runs it as written.

What counts as a launcher: the first word of the command, or of any command in a `sh|bash [OPTIONS] -c
SCRIPT` (`bash -lc`, `bash -e -o pipefail -c`; after `;`, `&&`, `||`, `|`, past `VAR=value` assignments
and `env`/`exec`/`nohup`; a shell inside the script too): torchrun,
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
SHELLS = ("sh", "bash", "dash", "zsh")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def launcher_in(command: Sequence[str]) -> str | None:
    """The launcher the command starts (as the user would name it), or None."""
    words = list(command)
    script = _shell_script(words)
    if script is None:
        return _launcher_at(words)
    try:
        parts = _commands(shlex.split(script, comments=True))
    except ValueError:  # unbalanced quotes: the shell will say so
        return None
    return next(filter(None, (launcher_in(part) for part in parts)), None)  # a shell inside the script too


def _shell_script(words: list[str]) -> str | None:
    """The script of `sh|bash [OPTIONS] -c SCRIPT` (`bash -lc`, `bash -e -o pipefail -c`), else None: the
    first word after the options, where one of them holds `c` (bash's own rule)."""
    rest = _past_prefixes(words)
    if not rest or rest[0].rsplit("/", 1)[-1] not in SHELLS:
        return None
    rest, has_c = rest[1:], False
    while rest and rest[0][:1] in ("-", "+") and rest[0] not in ("-", "--"):
        option, rest = rest[0], rest[1:]
        if option.startswith("--"):  # --login, --norc; --rcfile FILE and --init-file FILE take a word
            rest = rest[1:] if option in ("--rcfile", "--init-file") else rest
            continue
        has_c = has_c or "c" in option
        if option[-1] in "oO":  # -o pipefail, -O extglob: the next word is the option's
            rest = rest[1:]
    rest = rest[1:] if rest[:1] in (["-"], ["--"]) else rest
    return rest[0] if has_c and rest else None


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


def _past_prefixes(words: Sequence[str]) -> list[str]:
    """`env -i A=1 torchrun ...`: the words past the prefix commands, their flags and the assignments."""
    rest = list(words)
    while rest and (rest[0] in _PREFIXES or _ASSIGNMENT.match(rest[0]) or rest[0].startswith("-")):
        rest = rest[1:]
    return rest


def _launcher_at(words: Sequence[str]) -> str | None:
    rest = _past_prefixes(words)
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
