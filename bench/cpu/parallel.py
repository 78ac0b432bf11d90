"""Model parallelism's figures, each beside its baseline in the same run:

* parameter bytes per rank under FSDP over N = 2 and 4 processes against one process holding the
  whole model (gpt-125m; the ideal reduction is N);
* the measured pipeline bubble against (p-1)/(m+p-1) for GPipe on 2 stages of equal, fixed time
  (``training.torch.parallel.pipeline_check``; the schedule alone, without this machine's noise);
* the step time of FSDP against DDP for the same model, batch and optimizer at world size 2,
  over gloo (interleaved rounds).
"""

from __future__ import annotations

from bench.harness import proc
from bench.harness.results import Figure
from training.torch.parallel.pipeline_check import measure_bubbles

WORKER = "bench.cpu.parallel_worker"
MEMORY_WORLDS = (2, 4)
BUBBLE_STAGES = 2
BUBBLE_MICROBATCHES = (2, 4, 8)
MiB = 2**20


def worker(np: int, mode: str, *args: str) -> dict:
    return proc.run_json("ddp", np, WORKER, ["--mode", mode, *args], threads=1)


def memory_figures(quick: bool) -> list[Figure]:
    model = ["--model", "bench-gpt" if quick else "gpt-125m", "--steps", "1", "--warmup", "0", "--seq-len", "32"]
    whole = worker(1, "plain", *model)
    unsharded = whole["parameter_bytes_per_rank"][0]
    figures = []
    for world in MEMORY_WORLDS:
        sharded = worker(world, "fsdp", *model)
        per_rank = max(sharded["parameter_bytes_per_rank"])
        rss = max(sharded["peak_memory_bytes_per_rank"]) / MiB
        figures.append(
            Figure(
                f"fsdp_memory_{world}",
                f"Parameter bytes per rank, FSDP over {world} processes, {whole['model']} "
                f"({whole['parameters'] / 1e6:.0f}M parameters)",
                "MiB",
                per_rank / MiB,
                unsharded / MiB,
                unsharded / per_rank,
                goal=0.9 * world,
                ours_label=f"FSDP, largest rank of {world}",
                baseline_label="one process, whole model",
                note=f"peak RSS per rank (runtime included): {rss:.0f} MiB sharded over {world}, "
                f"{whole['peak_memory_bytes_per_rank'][0] / MiB:.0f} MiB in one process",
            )
        )
    return figures


def bubble_figures(steps: int) -> list[Figure]:
    results = measure_bubbles(BUBBLE_STAGES, BUBBLE_MICROBATCHES, "gpipe", work="sleep", steps=steps)
    return [
        Figure(
            f"pipeline_bubble_m{r['microbatches']}",
            f"Pipeline bubble, GPipe, {BUBBLE_STAGES} equal stages, {r['microbatches']} microbatches",
            "fraction",
            r["measured"],
            r["theory"],
            r["theory"] / r["measured"],  # 1.0: exactly the theory; the overheads only add idle time
            goal=0.8,  # within 20% of (p-1)/(m+p-1)
            ours_label="measured",
            baseline_label="(p-1)/(m+p-1)",
        )
        for r in results
    ]


def fsdp_vs_ddp(rounds: int, quick: bool) -> Figure:
    shape = ["--steps", "3" if quick else "6", "--warmup", "1", "--seq-len", "32" if quick else "128"]
    fsdp: list[float] = []
    ddp: list[float] = []
    parameters = 0
    for _ in range(rounds):  # interleaved: a burst of load hits one pair, and the median of ratios drops it
        sharded = worker(2, "fsdp", *shape)
        fsdp.append(1 / sharded["step_s"])
        ddp.append(1 / worker(2, "ddp", *shape)["step_s"])
        parameters = sharded["parameters"]
    return Figure.from_rounds(
        "fsdp_vs_ddp",
        f"Steps/s at world size 2, FSDP2 against DDP, bench-gpt ({parameters / 1e6:.1f}M parameters), AdamW, gloo",
        "steps/s",
        fsdp,
        ddp,
        ours_label="FSDP2 (fully_shard per block)",
        baseline_label="DDP",
        note="FSDP trades an all-gather per block (forward and backward) and a reduce-scatter for "
        "DDP's one bucketed all-reduce: on gloo over loopback it costs time; it buys memory",
    )


def measure(rounds: int, quick: bool) -> list[Figure]:
    return [*memory_figures(quick), *bubble_figures(2 if quick else 4), fsdp_vs_ddp(rounds, quick)]
