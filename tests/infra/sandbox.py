"""Running the rendered scripts here: stub commands first on PATH, system paths pointed elsewhere."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is required by these tests and is not on PATH; install it (see .ci/run)")
    return path


# The units this machine's packages installed (systemd's targets, Debian's cloud-init), without the
# machine's own enablements under /etc.
PACKAGED_UNITS_DIR = Path("/lib/systemd/system")


def systemd_verify(
    directory: Path, units: Sequence[str], *, packaged_units_only: bool = False
) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` of the units named, looked up in directory first (drop-ins and .wants/
    too), then in systemd's own search path; packaged_units_only: then in PACKAGED_UNITS_DIR only, so
    that what is enabled is what directory's .wants/ say, not what this machine enabled."""
    search_path = f"{directory}:{PACKAGED_UNITS_DIR}" if packaged_units_only else f"{directory}:"
    return subprocess.run(
        [tool("systemd-analyze"), "verify", *units],
        cwd=directory,
        env={"SYSTEMD_UNIT_PATH": search_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )


def shell_value(script: str, name: str) -> str | list[str]:
    """Value of a top-level `NAME=...` (or `readonly NAME=...`) assignment; arrays as lists."""
    match = re.search(rf"^(?:readonly )?{name}=(.*)$", script, re.MULTILINE)
    assert match, f"{name} is not assigned in the script"
    value = match[1]
    if value.startswith("("):
        return shlex.split(value[1:-1])
    (word,) = shlex.split(value)
    return word


def with_value(script: str, name: str, value: str | int | list[str]) -> str:
    """The script with one top-level assignment replaced (how tests point system paths elsewhere)."""
    if isinstance(value, list):
        literal = "(" + " ".join(shlex.quote(item) for item in value) + ")"
    else:
        literal = shlex.quote(str(value))
    new, count = re.subn(
        rf"^(readonly )?{name}=.*$",
        lambda match: f"{match[1] or ''}{name}={literal}",
        script,
        flags=re.MULTILINE,
    )
    assert count == 1, f"{name} is assigned {count} times"
    return new


def add_port(sysfs: Path, device: str, link_layer: str, state: str, rate: str = "400 Gb/sec (4X NDR)") -> None:
    """An RDMA port under a stand-in for /sys/class/infiniband, as the kernel shows it (state "4: ACTIVE")."""
    port = sysfs / device / "ports" / "1"
    port.mkdir(parents=True)
    (port / "link_layer").write_text(f"{link_layer}\n")
    (port / "state").write_text(f"{state}\n")
    (port / "rate").write_text(f"{rate}\n")


class Sandbox:
    """Runs a script with stub commands first on PATH; each stub logs `name args` and runs its body."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.state = root / "state"
        self.log = root / "calls.log"
        self.bin.mkdir()
        self.state.mkdir()
        self.log.touch()

    def stub(self, name: str, body: str = "exit 0") -> None:
        path = self.bin / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >>"$STUB_LOG"\n{body}\n')
        path.chmod(0o755)

    def calls(self, name: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.split(" ", 1)[0] == name]

    def run(
        self, script: str, env: Mapping[str, str] | None = None, *, argv: Sequence[str] = (), interpreter: str = "bash"
    ) -> subprocess.CompletedProcess[str]:
        path = self.root / "script"
        path.write_text(script)
        # nvidia-smi must be absent unless a test stubs it.
        system_path = [
            entry
            for entry in os.environ["PATH"].split(os.pathsep)
            if entry and not (Path(entry) / "nvidia-smi").exists()
        ]
        full_env = {
            **os.environ,
            "PATH": os.pathsep.join([str(self.bin), *system_path]),
            "STUB_LOG": str(self.log),
            "STUB_STATE": str(self.state),
            **(env or {}),
        }
        return subprocess.run(
            [tool(interpreter), str(path), *argv],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
