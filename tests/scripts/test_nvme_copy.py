"""dtrain/remote/job/nvme_copy.py, run as the nodes run it (python3, a subprocess): a complete copy,
a resume after a kill mid-way, and verification that finds a truncated or corrupted local file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.remote.job.nvme_copy import JOURNAL, MARKER, TMP_SUFFIX

TOOL = Path(__file__).parents[2] / "dtrain" / "remote" / "job" / "nvme_copy.py"


def make_dataset(root: Path, files: int, size: int) -> Path:
    source = root / "source"
    for index in range(files):
        path = source / f"class{index % 10}" / f"image{index}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return source


def copy(source: Path, dest: Path, workers: int = 4) -> tuple[int, dict[str, int]]:
    argv = [sys.executable, str(TOOL), "--source", str(source), "--dest", str(dest), "--workers", str(workers)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1])


def data_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in root.rglob("*")
        if path.is_file() and path.name not in (JOURNAL, MARKER)
    }


def test_copies_everything_verified_then_marks_it_complete_and_a_rerun_copies_nothing(tmp_path: Path) -> None:
    source, dest = make_dataset(tmp_path, 40, 10_000), tmp_path / "nvme" / "data"
    code, summary = copy(source, dest)
    assert code == 0
    assert summary == {"files": 40, "bytes": 400_000, "copied": 40, "skipped": 0, "recopied": 0, "failed": 0}
    assert data_files(dest) == data_files(source)
    marker = json.loads((dest / MARKER).read_text())
    assert marker == {"source": str(source), "files": 40, "bytes": 400_000}

    code, summary = copy(source, dest)
    assert code == 0 and summary["copied"] == 0 and summary["skipped"] == 40


def test_a_killed_copy_resumes_where_it_stopped(tmp_path: Path) -> None:
    source, dest = make_dataset(tmp_path, 4000, 32 * 1024), tmp_path / "nvme"
    argv = [sys.executable, str(TOOL), "--source", str(source), "--dest", str(dest), "--workers", "1"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = dest / JOURNAL
    deadline = time.monotonic() + 60
    while not (journal.exists() and journal.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (dest / MARKER).exists(), "the copy finished before the kill: make the dataset larger"
    done_before = len(journal.read_text().splitlines())
    assert 0 < done_before < 4000

    code, summary = copy(source, dest)
    assert code == 0
    assert summary["skipped"] >= done_before - 1  # the journal's last line may be torn
    assert summary["copied"] == 4000 - summary["skipped"]
    assert data_files(dest) == data_files(source)
    assert not list(dest.rglob(f"*{TMP_SUFFIX}"))
    assert json.loads((dest / MARKER).read_text())["files"] == 4000


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_verification_finds_a_damaged_local_file_and_copies_it_again(tmp_path: Path, damage: str) -> None:
    source, dest = make_dataset(tmp_path, 20, 10_000), tmp_path / "nvme"
    assert copy(source, dest)[0] == 0
    victim = dest / "class3" / "image13.bin"
    data = victim.read_bytes()
    # Same size when corrupted: only the hash taken while copying can tell.
    victim.write_bytes(data[:5000] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 0xFF]))

    code, summary = copy(source, dest)
    assert code == 0
    assert summary["copied"] + summary["recopied"] == 1
    assert victim.read_bytes() == (source / "class3" / "image13.bin").read_bytes()
    assert (dest / MARKER).exists()


def test_refuses_a_destination_inside_the_source(tmp_path: Path) -> None:
    source = make_dataset(tmp_path, 1, 10)
    code, summary = copy(source, source / "copy")
    assert code == 2 and "--dest outside --source" in summary["error"]
