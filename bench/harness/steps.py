"""Training-step throughput: the jobs (``training.*``) and the bare loop, each a fresh process.

Every rate is images/s after the job's own timing warmup (``--timing-warmup-steps``), as the
job's metrics JSON reports it: the global batch over the slowest rank's measured time.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import proc


@dataclass(frozen=True)
class Shape:
    """Model and sizes shared by every training-step figure."""

    model: str = "resnet50"
    image_size: int = 32
    batch: int = 32
    steps: int = 10
    warmup: int = 2
    num_classes: int = 1000

    def args(self) -> list[str]:
        return [
            *("--model", self.model, "--image-size", str(self.image_size)),
            *("--batch-size", str(self.batch), "--num-classes", str(self.num_classes)),
            *("--steps", str(self.steps), "--timing-warmup-steps", str(self.warmup)),
        ]

    def describe(self) -> str:
        return f"{self.model}, {self.image_size}px, batch {self.batch}/worker"


def job_rate(
    shape: Shape,
    framework: str = "pytorch",
    launcher: str = "horovod",
    workers: int = 1,
    threads: int = 1,
    extra: tuple[str, ...] = (),
) -> float:
    """Aggregate images/s of ``python -m training.<framework>`` on synthetic data."""
    args = ["--data", "synthetic", "--log-every", str(shape.steps), *shape.args(), *extra]
    if launcher == "ddp":
        args += ["--backend", "ddp"]
    metrics = proc.run_json(launcher, workers, f"training.{framework}", args, threads)
    if metrics.get("world_size") != workers:
        raise proc.BenchError(f"expected {workers} workers, the job reports {metrics.get('world_size')}")
    return float(metrics["images_per_sec"])


def bare_rate(shape: Shape, threads: int = 1) -> float:
    args = [
        *("--model", shape.model, "--image-size", str(shape.image_size), "--batch-size", str(shape.batch)),
        *("--num-classes", str(shape.num_classes), "--steps", str(shape.steps)),
        *("--timing-warmup-steps", str(shape.warmup)),
    ]
    return float(proc.run_json("plain", 1, "bench.cpu.bare_loop", args, threads)["images_per_sec"])
