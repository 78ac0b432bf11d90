"""The documentation's commands, run as written: every `bash` block of README.md and docs/*.md that
carries no reason not to run (tests/doc_blocks.py), one shell per document, `set -euo pipefail`, its
blocks in order, from the checkout, with .venv/bin on PATH as the docs say. A block that cannot run
and says nothing fails here; the others are listed with their reason.

They run against a local cluster of the test's own, which the documents' own `dtrain local up` makes:
XDG_STATE_HOME moves the default state directory (and with it the description every command reads)
and DTRAIN_LOCAL_NAME and DTRAIN_LOCAL_SUBNET give `local up` the test's name and a claimed subnet.
A document whose blocks use a cluster without making one gets one made the same way first.
Whatever a document leaves up is taken down after it, and must leave nothing behind.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dtrain.cluster.description import CONFIG_DIR_NAME
from dtrain.local import cluster as local_cluster
from tests.doc_blocks import COMMANDS, DOCS, NOT_RUN, REPO, Block, blocks

from .conftest import cluster_name, free_subnet, leftovers

RUNNABLE = {doc: [block for block in blocks(doc) if block.runs] for doc in DOCS}
# A hang guard, not a measure: a document's blocks take minutes on a loaded 2-core machine, each
# command ending by itself (a launch after its steps, `local up` within its own timeouts).
DOC_GUARD_S = 1800
TMP_PATH = re.compile(r"(?<![\w./])/tmp/[\w.-]+")
TAIL = 6000


def listing(doc: Path) -> list[str]:
    """What runs of a document and what does not, with the reason."""
    return [
        f"run: {block.where}" if block.runs else f"not run: {block.where}: {NOT_RUN[block.marks[0]]}"
        for block in blocks(doc)
        if block.language == COMMANDS
    ]


def script(runnable: list[Block]) -> str:
    """The blocks in order under `set -euo pipefail`, each after a comment naming where it is; the ERR
    trap names the command that failed."""
    lines = ["set -euo pipefail", """trap 'echo "failed (exit $?): $BASH_COMMAND" >&2' ERR"""]
    for block in runnable:
        lines += [f"# --- {block.where}", block.body.rstrip("\n")]
    return "\n".join(lines) + "\n"


def user_env(tmp_path: Path) -> dict[str, str]:
    """A user's environment in the checkout after `make setup`, with the test's local cluster as theirs."""
    env = {key: value for key, value in os.environ.items() if key != "CLUSTER_DESCRIPTION"}
    return env | {
        "PATH": f"{REPO / '.venv' / 'bin'}:{env['PATH']}",
        "PYTHONPATH": str(REPO),  # this checkout's code, whichever checkout .venv was installed from
        "XDG_STATE_HOME": str(tmp_path / "state"),
        local_cluster.NAME_ENV: cluster_name("m"),
        local_cluster.SUBNET_ENV: free_subnet(),
        "COLUMNS": "200",
    }


def in_terminal(text: str, env: dict[str, str]) -> tuple[int, str]:
    """`bash -c text` writing to a terminal (a pseudo-terminal), as a user's commands do: `launch`
    follows its job to the end there, where with its output in a pipe it would print the job id and
    return. No input: nothing answers a prompt. The exit status and everything written."""
    reader, writer = pty.openpty()
    proc = subprocess.Popen(
        ["bash", "-c", text], cwd=REPO, env=env | {"NO_COLOR": "1"}, stdin=subprocess.DEVNULL,
        stdout=writer, stderr=writer, start_new_session=True,
    )  # fmt: skip
    os.close(writer)
    output = bytearray()
    deadline = time.monotonic() + DOC_GUARD_S
    try:
        while True:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"still running after {DOC_GUARD_S} s:\n{output[-TAIL:].decode(errors='replace')}")
            if select.select([reader], [], [], 1)[0]:
                try:
                    output += os.read(reader, 65536)
                except OSError:  # EIO: nothing holds the terminal any more
                    break
            elif proc.poll() is not None:
                break  # ended, and all it wrote is read
    finally:
        os.close(reader)
    return proc.wait(), output.decode(errors="replace").replace("\r\n", "\n")


def test_every_command_block_not_run_is_listed_with_its_reason():
    """The list (pytest -rP shows it); the README's local workflow is among what runs."""
    lines = [line for doc in DOCS for line in listing(doc)]
    print("\n".join(lines))
    assert len(lines) == sum(block.language == COMMANDS for doc in DOCS for block in blocks(doc))
    assert [line for line in lines if line.startswith("run: README.md")], "the README's local workflow must run"


@pytest.mark.parametrize(
    "doc", [doc for doc, runnable in RUNNABLE.items() if runnable], ids=lambda doc: str(doc.relative_to(REPO))
)
def test_the_documents_commands_run_as_written(doc: Path, tmp_path: Path):
    runnable = RUNNABLE[doc]
    text = script(runnable)
    print("\n".join(listing(doc)))
    env = user_env(tmp_path)
    state, name = Path(env["XDG_STATE_HOME"]) / CONFIG_DIR_NAME / "local-cluster", env[local_cluster.NAME_ENV]
    named_in_tmp = {Path(path) for path in TMP_PATH.findall(text)}
    ours = {path for path in named_in_tmp if not path.exists()}  # what the blocks make there, removed after
    downloads = REPO / "runs"  # where `dtrain results` puts a run, from the checkout
    before = set(downloads.iterdir()) if downloads.is_dir() else None
    started = time.monotonic()
    try:
        if "dtrain " in text and "dtrain local up" not in text:  # uses a cluster it does not make
            made, output = in_terminal("dtrain local up --nodes 2", env)
            assert made == 0, output[-TAIL:]
        status, output = in_terminal(text, env)
    finally:
        if state.exists():
            local_cluster.down(state, quiet=True)
        if before is None:
            ours.add(downloads)
        elif downloads.is_dir():
            ours |= set(downloads.iterdir()) - before
        for path in ours:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    print(f"{doc.relative_to(REPO)}: {len(runnable)} blocks in {time.monotonic() - started:.0f} s")
    assert status == 0, f"{doc.relative_to(REPO)}'s commands failed:\n{output[-TAIL:]}\n\n{text}"
    assert leftovers(state, name) == []
