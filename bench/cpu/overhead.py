"""Figure 1: our PyTorch job's step against the bare loop, world size 1, Horovod initialised."""

from __future__ import annotations

from bench.harness import steps
from bench.harness.results import Figure


def job(shape: steps.Shape, threads: int) -> float:
    return steps.job_rate(shape, "pytorch", "horovod", 1, threads)


def measure(shape: steps.Shape, rounds: int, threads: int) -> Figure:
    ours: list[float] = []
    bare: list[float] = []
    for i in range(rounds):  # interleaved pairs (see results.paired_ratio), alternating which goes first
        pair = (lambda: bare.append(steps.bare_rate(shape, threads)), lambda: ours.append(job(shape, threads)))
        for run in pair if i % 2 == 0 else reversed(pair):
            run()
    return Figure.from_rounds(
        "overhead",
        f"Framework overhead, {shape.describe()}, {threads} thread(s), horovodrun -np 1",
        "images/s",
        ours,
        bare,
        goal=0.97,
        ours_label="training.pytorch",
        baseline_label="bare loop",
    )
