"""Communication efficiency, Horovod and DDP: the same 2 ranks with the gradient allreduce against
without it (``bench.cpu.comm_worker``), in wall time and in CPU time, interleaved rounds.

It replaces a 1 -> 2 process scaling figure, which divided by twice the one-process rate and so
measured mostly whether a neighbour held this 2-core machine's second core. Here both sides run
2 processes at the same moment in the run, so what differs is the allreduce alone. The analytical
model's prediction for the same setting (measured step time, measured allreduce bandwidth) is
attached as a note, a check of the model on hardware we can run.
"""

from __future__ import annotations

from bench.harness import proc, steps
from bench.harness.results import Figure, paired_ratio
from bench.harness.scaling_model import RESNET50_PARAMS, Workload, efficiency

LAUNCHERS = {"horovod": "Horovod (horovodrun --gloo)", "ddp": "DDP (torchrun, gloo)"}
WORKERS = 2


def run(shape: steps.Shape, launcher: str, allreduce: str) -> dict[str, float]:
    args = [
        *("--launcher", launcher, "--allreduce", allreduce, "--model", shape.model),
        *("--image-size", str(shape.image_size), "--batch-size", str(shape.batch)),
        *("--num-classes", str(shape.num_classes), "--steps", str(shape.steps)),
        *("--timing-warmup-steps", str(shape.warmup)),
    ]
    result = proc.run_json(launcher, WORKERS, "bench.cpu.comm_worker", args, threads=1)
    if result.get("world_size") != WORKERS:
        raise proc.BenchError(f"expected {WORKERS} ranks, the worker reports {result.get('world_size')}")
    return result


def measure(shape: steps.Shape, rounds: int, launcher: str, bus_gbps: float | None) -> Figure:
    on: list[dict[str, float]] = []
    off: list[dict[str, float]] = []
    for i in range(rounds):  # interleaved pairs, alternating which goes first
        pair = (lambda: on.append(run(shape, launcher, "on")), lambda: off.append(run(shape, launcher, "off")))
        for side in pair if i % 2 == 0 else reversed(pair):
            side()
    figure = Figure.from_rounds(
        f"comm_efficiency_{launcher}",
        f"Communication efficiency, {WORKERS} ranks, {LAUNCHERS[launcher]}, {shape.describe()}",
        "images/s",
        [r["images_per_sec"] for r in on],
        [r["images_per_sec"] for r in off],
        goal=0.85,
        ours_label="with the allreduce",
        baseline_label="the same ranks without it",
    )
    cpu = paired_ratio([r["images_per_cpu_s"] for r in on], [r["images_per_cpu_s"] for r in off])
    figure.samples |= {
        "ours_images_per_cpu_s": [r["images_per_cpu_s"] for r in on],
        "baseline_images_per_cpu_s": [r["images_per_cpu_s"] for r in off],
    }
    figure.note = f"in CPU time: {cpu:.2f}"
    if bus_gbps and shape.model == "resnet50" and figure.baseline:
        work = Workload.from_throughput(figure.baseline / WORKERS, shape.batch, RESNET50_PARAMS * 4)
        figure.note += (
            f"; model: {efficiency(work, WORKERS, bus_gbps * 1e9):.2f} with overlap 0.5, "
            f"{efficiency(work, WORKERS, bus_gbps * 1e9, overlap=0):.2f} without (measured allreduce bus bandwidth)"
        )
    return figure
