"""Figure 6 (information): TensorFlow and Keras jobs against the PyTorch job, same model and sizes."""

from __future__ import annotations

from bench.harness import steps
from bench.harness.results import Figure


def measure(shape: steps.Shape, rounds: int, threads: int) -> list[Figure]:
    rates: dict[str, list[float]] = {"pytorch": [], "tensorflow": [], "keras": []}
    for _ in range(rounds):
        for framework, values in rates.items():
            values.append(steps.job_rate(shape, framework, "horovod", 1, threads))
    return [
        Figure.from_rounds(
            f"framework_{framework}",
            f"{framework} job vs pytorch job, {shape.describe()}, {threads} thread(s)",
            "images/s",
            rates[framework],
            rates["pytorch"],
            ours_label=f"training.{framework}",
            baseline_label="training.pytorch",
        )
        for framework in ("tensorflow", "keras")
    ]
