"""The speed guard of the trainer merge: each layout's training step runs the same torch operators, and
the same losses come out of 20 steps, as the code did when the figures were recorded.

For the plain ResNet-50 DDP step and each GPT layout that runs on CPU over gloo, a 2-rank torchrun job
runs under tests/training/op_census.py, which records on every rank the operators of one training step
(counted by name, after two warm-up steps) and every cross-entropy value of the run. The figures of the
code before the merge are tests/training/data/trainer_census.json; this module runs the same work with the
code as it is and compares.

* **Operator counts: equal.** Same work, same operators: an extra copy, a lost fusion, a new host sync
  (``aten._local_scalar_dense``) or collective shows up here as a count, without a GPU. A difference that
  is meant (a layout now does its work another way) is recorded again, with the reason in the commit.
* **Losses: within 1e-6 relative** (absolute 1e-9 for the ResNet's losses near zero). Same operators on
  the same data in the same order give the same bits; reruns of each case here were identical bit for
  bit. The margin admits a CPU of another generation, whose oneDNN/MKL kernels may round differently;
  a change to the math (a lost gradient average, another initialization, another batch) moves the
  second step's loss by far more (the recorded losses move by more than 1e-2 between steps).
* The figures are torch's as much as ours (its decompositions name the operators), so they hold for
  the torch version that recorded them; under another one the comparison is skipped with the reason.

Regenerate (about a minute on two cores, with the code whose figures are the reference)::

    .venv-train/bin/python -m tests.training.test_trainer_equivalence --write
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.jobs import run, torchrun

FIXTURE = Path(__file__).parent / "data" / "trainer_census.json"
RANKS = 2
STEPS = 20
RELATIVE, ABSOLUTE = 1e-6, 1e-9  # on losses (see the module docstring)
GPT = [
    "--model", "gpt-tiny", "--seq-len", 32, "--steps", STEPS, "--lr", "3e-3", "--seed", 7,
    "--log-every", STEPS, "--timing-warmup-steps", 1,
]  # fmt: skip
# name: the trainer's module and flags (2 ranks). Global batch 8 sequences for every GPT layout.
CASES: dict[str, list[Any]] = {
    "resnet50-ddp": [
        "training.pytorch", "--backend", "ddp", "--model", "resnet50", "--image-size", 32, "--num-classes", 10,
        "--batch-size", 2, "--steps", STEPS, "--log-every", STEPS, "--timing-warmup-steps", 1,
    ],
    "gpt-replicate-2": ["training.model_parallel", *GPT, "--dp-shard", 1, "--batch-size", 4],
    "gpt-fsdp-2": ["training.model_parallel", *GPT, "--dp-shard", 2, "--batch-size", 4],
    "gpt-tp-2": ["training.model_parallel", *GPT, "--tp", 2, "--batch-size", 8],
    "gpt-pp-2": ["training.model_parallel", *GPT, "--pp", 2, "--batch-size", 8],
}  # fmt: skip


def census(name: str, out: Path) -> list[dict[str, Any]]:
    """Every rank's record (op_census.py) of case ``name``, run under torchrun."""
    out.mkdir(parents=True, exist_ok=True)
    run(torchrun(RANKS, out, *CASES[name], module="tests.training.op_census"), out / "job.log", timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.machine()


def recorded() -> dict[str, Any]:
    figures = json.loads(FIXTURE.read_text())
    if figures["torch"] != torch.__version__:
        pytest.skip(f"the figures are of torch {figures['torch']}, this is {torch.__version__}: operators are torch's")
    return figures


@pytest.mark.parametrize("name", CASES)
def test_step_operators_and_losses_are_unchanged(tmp_path: Path, name: str) -> None:
    figures = recorded()
    before = figures["cases"][name]["ranks"]
    where = f"recorded on {figures['cpu']}, measured on {cpu_model()}"
    after = census(name, tmp_path)
    for rank, (old, new) in enumerate(zip(before, after, strict=True)):
        assert new["ops"] == old["ops"], f"rank {rank}: {changed_counts(old['ops'], new['ops'])}"
        assert len(new["losses"]) == len(old["losses"]), f"rank {rank}: another number of losses"
        expected = pytest.approx(old["losses"], rel=RELATIVE, abs=ABSOLUTE)
        assert new["losses"] == expected, f"rank {rank}, {where}"
    # the comparison means something only where the run computed losses and moved them
    losses = [loss for record in before for loss in record["losses"]]
    assert len(losses) >= STEPS and max(losses) - min(losses) > 1e-2


def changed_counts(old: dict[str, int], new: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The operators whose count differs: (before, after)."""
    return {
        op: (old.get(op, 0), new.get(op, 0)) for op in sorted(old.keys() | new.keys()) if old.get(op) != new.get(op)
    }


def write(directory: Path) -> None:
    """Record every case's figures with the code as it is (the reference for later changes)."""
    cases = {
        name: {"command": [str(part) for part in command], "ranks": census(name, directory / name)}
        for name, command in CASES.items()
    }
    figures = {"torch": torch.__version__, "cpu": cpu_model(), "cases": cases}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python -m tests.training.test_trainer_equivalence --write (rewrites {FIXTURE})")
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        write(Path(scratch))
