"""Figure 2: 1 against 2 processes on this machine (gloo, one thread each), Horovod and DDP.

Efficiency is the 2-process aggregate rate over twice the 1-process rate, per interleaved
round. The analytical model's prediction for the same setting (measured step time, measured
allreduce bandwidth) is attached as a note, a check of the model on hardware we can run.
"""

from __future__ import annotations

from bench import steps
from bench.results import Figure
from bench.scaling_model import RESNET50_PARAMS, Workload, efficiency

LAUNCHERS = {"horovod": "Horovod (horovodrun --gloo)", "ddp": "DDP (torchrun, gloo)"}


def measure(shape: steps.Shape, rounds: int, launcher: str, bus_gbps: float | None) -> Figure:
    single: list[float] = []
    double: list[float] = []
    for _ in range(rounds):
        single.append(2 * steps.job_rate(shape, "pytorch", launcher, 1, threads=1))
        double.append(steps.job_rate(shape, "pytorch", launcher, 2, threads=1))
    figure = Figure.from_rounds(
        f"scaling_{launcher}",
        f"Scaling 1 -> 2 processes, {LAUNCHERS[launcher]}, {shape.describe()}",
        "images/s",
        double,
        single,
        goal=0.85,
        ours_label="2 procs",
        baseline_label="2 x 1 proc",
    )
    if bus_gbps and shape.model == "resnet50" and figure.baseline:
        work = Workload.from_throughput(figure.baseline / 2, shape.batch, RESNET50_PARAMS * 4)
        figure.note = (
            f"model: {efficiency(work, 2, bus_gbps * 1e9):.2f} with overlap 0.5, "
            f"{efficiency(work, 2, bus_gbps * 1e9, overlap=0):.2f} without (measured allreduce bus bandwidth)"
        )
    return figure
