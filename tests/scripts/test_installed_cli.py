"""The operator CLI as a user installs it: `pip install -e .` gives `dtrain`, which runs from any
directory (here /tmp), completes its commands in the shell (argcomplete), and prints JSON for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .conftest import REPO


@pytest.fixture(scope="module")
def dtrain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the project installed, editable, as the README says; the operator
    environment's packages (its dependencies) are on its path, so nothing else is downloaded but the
    build backend and argcomplete."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "operator-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q"]
    requirements = (REPO / "requirements-cli.txt").read_text().splitlines()
    argcomplete = next(line for line in requirements if line.startswith("argcomplete=="))
    for args in (["--no-deps", "-e", str(REPO)], [argcomplete]):
        proc = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return venv / "bin" / "dtrain"


def test_the_installed_command_runs_from_any_directory_and_prints_json(dtrain, cluster_file):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shown = subprocess.run([str(dtrain), "--help"], cwd="/tmp", env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: dtrain "), shown.stderr
    pipeline = f"{dtrain} jobs --cluster {cluster_file} --json | {sys.executable} -m json.tool"
    proc = subprocess.run(pipeline, shell=True, cwd="/tmp", env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and isinstance(json.loads(proc.stdout)["jobs"], list), proc.stderr
    status = subprocess.run(
        [str(dtrain), "status", "--cluster", str(cluster_file), "--json"], cwd="/tmp", env=env, capture_output=True
    )
    nodes = json.loads(status.stdout)["nodes"]
    assert status.returncode == 0 and [node["name"] for node in nodes] == ["node-0", "node-1"]


def test_the_shell_completes_commands_and_flags(dtrain, tmp_path):
    """What bash's hook (`eval "$(register-python-argcomplete dtrain)"`) asks the command, and its answer."""

    def complete(line: str) -> set[str]:
        answer = tmp_path / "completions"
        env = {**os.environ, "_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line))}
        env |= {"_ARGCOMPLETE_IFS": "\n", "_ARGCOMPLETE_STDOUT_FILENAME": str(answer)}
        proc = subprocess.run([str(dtrain)], env=env, cwd="/tmp", capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return set(answer.read_text().split())

    assert {"launch", "local", "logs"} <= complete("dtrain l")
    assert {"--workdir", "--workdir-max-mb"} <= complete("dtrain launch --work")
