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

In per-node mode over several nodes, a torchrun (or `python -m torch.distributed.run|launch`) must be told
how the nodes join one world: `--nnodes` with `--node-rank` and `--master-addr`, or `--rdzv-endpoint`
(as `--flag value` or `--flag=value`, with `-` or `_`, or torchrun's own `PET_*` variables). Without them
each node trains a world of its own (torchrun's defaults: one node, rank 0, a master on 127.0.0.1).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

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
    found = launcher_words(command)
    return found[0] if found else None


def launcher_words(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """The launcher the command starts and the words of the simple command that starts it (assignments
    and prefixes included), or None."""
    words = list(command)
    script = _shell_script(words)
    if script is None:
        launcher = _launcher_at(words)
        return (launcher, words) if launcher else None
    try:
        parts = _script_commands(script)
    except ValueError:  # unbalanced quotes: the shell will say so
        return None
    return next(filter(None, (launcher_words(part) for part in parts)), None)  # a shell inside the script too


def _script_commands(script: str) -> list[list[str]]:
    """A shell script's simple commands: split at `;`, `&&`, `||`, `|`, `&` and at the end of each line
    (a `\\`-newline continues it; a quote left open runs on into the next line), comments left out."""
    commands: list[list[str]] = []
    pending = ""
    for line in script.replace("\\\n", "").split("\n"):
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the line goes on
            continue
        commands.extend(_commands(words))
        pending = ""
    if pending:
        raise ValueError("unbalanced quotes")
    return commands


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


def check_launcher_mode(
    command: Sequence[str], mode: str, flag_mode: str, nodes: int = 1, envs: Mapping[str, str] | None = None
) -> None:
    """One `error:` line when the command's own launcher cannot run in the chosen mode (flag_mode: how
    the user sets the mode, e.g. '--mode per-node (task file: mode: per-node)'), or, per node over
    several nodes, would not join them into one world (envs: the job's variables, for torchrun's PET_*)."""
    found = launcher_words(command)
    if found is None:
        return
    launcher, words = found
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
    if launcher in TORCHRUNS and nodes > 1:
        check_torchrun_joins_nodes(launcher, words, nodes, envs or {})


TORCHRUNS = ("torchrun", "python -m torch.distributed.run", "python -m torch.distributed.launch")
# torchrun's flags that take no value (every other one takes one): past them, the first other word is the script
_TORCHRUN_SWITCHES = frozenset(
    ("standalone", "module", "m", "no-python", "run-path", "use-env", "virtual-local-rank", "help", "h")
)
JOIN_FLAGS = (
    '--nnodes "$DTRAIN_NUM_NODES" --node-rank "$DTRAIN_NODE_RANK" '
    '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"'
)


def torchrun_options(words: Sequence[str]) -> dict[str, str] | None:
    """torchrun's options in a simple command (names without dashes, `_` as `-`; a switch's value is ''),
    its `PET_*` assignments among them; None where a word could expand to options (`$ARGS`, `"$@"`)."""
    options: dict[str, str] = {}
    rest = list(words)
    while rest and (rest[0] in _PREFIXES or _ASSIGNMENT.match(rest[0]) or rest[0].startswith("-")):
        name, _, value = rest.pop(0).partition("=")
        if name.startswith("PET_") and value:
            options[name[4:].lower().replace("_", "-")] = value
    program = rest.pop(0).rsplit("/", 1)[-1] if rest else ""
    if _PYTHON.fullmatch(program):
        rest = rest[2:]  # -m torch.distributed.run
    while rest:
        word = rest.pop(0)
        if word.startswith("$"):  # `$ARGS`, `"$@"`: what it holds is the shell's to say
            return None
        if not word.startswith("-") or word == "--":
            break  # the script: what follows is its own
        name, equals, value = word.lstrip("-").partition("=")
        name = name.replace("_", "-")
        if not equals and name not in _TORCHRUN_SWITCHES:
            value = rest.pop(0) if rest else ""
        options[name] = value
    return options


def check_torchrun_joins_nodes(launcher: str, words: Sequence[str], nodes: int, envs: Mapping[str, str]) -> None:
    """Refused where the nodes' torchruns would not join one world: each would train a model of its own."""
    options = torchrun_options(words)
    if options is None:
        return
    options = {name[4:].lower().replace("_", "-"): "" for name in envs if name.startswith("PET_")} | options
    why = ""
    if "standalone" in options:
        why = "--standalone keeps each rendezvous on its own node"
    elif "nnodes" not in options:
        why = "it has no --nnodes (torchrun's default: 1 node)"
    elif re.fullmatch(r"(\d+:)?\d+", options["nnodes"]) and int(options["nnodes"].rsplit(":", 1)[-1]) < nodes:
        why = f"--nnodes {options['nnodes']} is fewer than the job's {nodes} nodes"
    elif "rdzv-endpoint" not in options:
        missing = [flag for flag in ("node-rank", "master-addr") if flag not in options]
        if missing:
            why = f"it has neither --rdzv-endpoint nor --{' nor --'.join(missing)}"
    if why:
        raise OperatorError(
            f"the command's {launcher} runs once on each of {nodes} nodes, and {why}: each node would train a "
            f"world of its own; join them with {JOIN_FLAGS} (or --rdzv-endpoint HOST:PORT)"
        )
