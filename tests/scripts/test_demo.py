"""End to end: the `make demo` flow (python -m scripts.demo), and its tear-down when a step fails."""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest

from scripts import demo, stage
from scripts.errors import OperatorError

from .conftest import cluster_name, free_subnet, run_module


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def test_demo_flow_end_to_end(tmp_path):
    state, runs = tmp_path / "state", tmp_path / "runs"
    name = cluster_name("d")
    proc = run_module(
        "scripts.demo", "--state-dir", str(state), "--runs-dir", str(runs), "--name", name,
        "--subnet", free_subnet(), timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # the stages, in order
    for marker in ("1/5 local cluster", "staging upload", "pull onto the NFS server", "preflight", "5/5 tear down"):
        assert marker in out
    assert re.search(r"^\[0\|node-0\]! .*step 6/6 .*loss", out, re.M)  # the job's log, prefixed with rank and host
    # the summary table
    assert "demo summary" in proc.stdout
    assert re.search(r"nodes\s+│ node-0, node-1", proc.stdout)
    images_per_sec = float(re.search(r"images/s \(all ranks\)\s+│ ([\d.]+)", proc.stdout).group(1))
    final_loss = float(re.search(r"final loss\s+│ ([\d.]+)", proc.stdout).group(1))
    assert images_per_sec > 0 and math.isfinite(final_loss)
    assert re.search(
        r"results container\s+│ http://127\.0\.0\.1:\d+/devstoreaccount1/results/\S+/ +\((\d+) blobs", proc.stdout
    )
    # the run, kept locally
    (run_dir,) = list(runs.iterdir())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["framework"] == "pytorch" and metrics["world_size"] == 2 and metrics["steps"] == 6
    record = json.loads((run_dir / "run.json").read_text())
    assert record["exit_code"] == 0 and "--data imagenet" in record["command"]
    # and the cluster is gone
    assert not state.exists() and not [n for n in namespaces() if n.startswith(f"{name}-")]


def test_demo_tears_down_when_a_step_fails(tmp_path, monkeypatch):
    def broken_pull(*args, **kwargs):
        raise OperatorError("pull verification failed: injected", 2)

    monkeypatch.setattr(stage, "pull", broken_pull)
    name = cluster_name("f")
    result = demo.run_demo(state_dir=tmp_path / "state", runs_dir=tmp_path / "runs", name=name, subnet=free_subnet())
    assert result.exit_code == 2 and "injected" in result.error
    assert "down" in result.timings and not (tmp_path / "state").exists()
    assert not [n for n in namespaces() if n.startswith(f"{name}-")]
    table = demo.summary_table(result)
    assert table.row_count >= 5


@pytest.mark.parametrize("steps", [8])
def test_job_flags_point_at_the_staged_data(cluster, steps):
    flags = demo.job_flags(cluster, steps, 8, 64, "resnet50")
    assert flags[flags.index("--data-dir") + 1] == f"{cluster.data_path}/{demo.DATASET}"
    assert flags[flags.index("--data") + 1] == "imagenet" and flags[flags.index("--steps") + 1] == str(steps)
