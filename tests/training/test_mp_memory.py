"""FSDP's memory: what each rank stores, and a model that fits only when sharded.

1. Parameter bytes per rank under FSDP over N = 2 and 4 ranks: at most total / N plus one block
   (FSDP shards every parameter on dim 0; a rank's share of one tensor is at most a row more
   than an even split), and the shards add up to the whole model.
2. The budget: gpt-125m's full fp32 training state (parameters, gradients and AdamW's two moments,
   16 bytes per parameter: 2.6 GB) does not fit a per-process memory budget (BUDGET), and the
   same model trains within that budget when FSDP shards it over 4 processes (0.65 GB of state
   each). The budget is enforced by the kernel where the machine allows it: each rank runs in a
   memory cgroup (v1) of its own with ``memory.limit_in_bytes = BUDGET``, so a process that
   exceeds it is OOM-killed. Unsharded, rank 0 is killed (the cgroup counts an OOM kill); sharded,
   every rank finishes. Where cgroups cannot be created (no root, no cgroup v1 memory controller)
   the test measures instead: each rank's peak RSS (the job's ``peak_memory_bytes_per_rank``)
   against the same budget, unsharded above it and sharded below it.

   The budget covers everything a process holds: the Python runtime and torch's libraries (about
   0.35 GB), the model as every rank first builds it whole (0.65 GB, freed as FSDP shards it), the
   sharded state, one block's gathered parameters, and the activations of a short sequence.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.training.jobs import REPO, TORCHRUN, run, torchrun
from training.config.models import GPT_CONFIGS, parameter_count
from training.model_parallel import METRIC_KEYS
from training.run.metrics import validate_metrics

GiB = 2**30
BUDGET = 2 * GiB  # per process
# glibc keeps freed blocks below its dynamic mmap threshold (which grows up to 32 MB) in its arenas,
# so a CPU process's RSS creeps up over the steps with memory no tensor holds. A fixed 1 MiB
# threshold returns every large block to the kernel when it is freed: RSS is then what the job
# holds, in both runs alike (docs/parallelism.md suggests the same for memory-bound CPU runs).
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
BIG = ["--model", "gpt-125m", "--seq-len", 16, "--steps", 2, "--log-every", 1]
TINY = ["--model", "gpt-tiny", "--seq-len", 16, "--batch-size", 2, "--steps", 2, "--log-every", 1]


def train(tmp: Path, name: str, cmd: list[Any], expect_rc: int = 0) -> dict[str, Any] | None:
    metrics_path = tmp / f"{name}.json"
    run([*cmd, "--metrics-json", metrics_path], tmp / f"{name}.log", timeout=300, expect_rc=expect_rc, env=ALLOCATOR)
    if expect_rc != 0:
        return None
    metrics = json.loads(metrics_path.read_text())
    validate_metrics(metrics, METRIC_KEYS)
    return metrics


def block_bytes(model: str) -> int:
    """fp32 bytes of one transformer layer."""
    cfg = GPT_CONFIGS[model]
    return 4 * (parameter_count(replace(cfg, n_layers=1)) - parameter_count(replace(cfg, n_layers=0)))


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_parameter_bytes_per_rank(tmp_path: Path, world: int) -> None:
    metrics = train(tmp_path, f"fsdp-{world}", torchrun(world, *TINY, module="training.model_parallel"))
    assert metrics is not None
    total = metrics["parameters_total"]
    assert total == parameter_count(GPT_CONFIGS["gpt-tiny"])
    assert metrics["layout"]["dp_shard"] == world
    assert sum(metrics["parameters_per_rank"]) == total  # a partition: nothing duplicated, nothing lost
    bound = 4 * total / world + block_bytes("gpt-tiny")
    for rank, size in enumerate(metrics["parameter_bytes_per_rank"]):
        assert size <= bound, f"rank {rank} holds {size} parameter bytes, more than total/{world} + one block"


# --- The budget ------------------------------------------------------------------------------------


def memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory, if this process may create groups under it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                if (base / "memory.limit_in_bytes").is_file() and os.access(base, os.W_OK):
                    return base
    return None


@contextlib.contextmanager
def rank_cgroups(base: Path, ranks: int, limit: int) -> Iterator[Path]:
    """A test-owned group with one child per local rank, each limited to ``limit`` bytes."""
    group = base / f"mp-budget-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        for rank in range(ranks):
            child = group / f"rank{rank}"
            child.mkdir()
            (child / "memory.limit_in_bytes").write_text(str(limit))
            if (child / "memory.memsw.limit_in_bytes").is_file():  # no escape into swap either
                (child / "memory.memsw.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        for rank in range(ranks):
            with contextlib.suppress(OSError):
                (group / f"rank{rank}").rmdir()
        group.rmdir()


def oom_kills(group: Path, rank: int) -> int:
    for line in (group / f"rank{rank}" / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return int((group / f"rank{rank}" / "memory.failcnt").read_text())  # older kernels: hits of the limit


def limited(tmp: Path, group: Path, world: int, *flags: Any) -> list[Any]:
    """torchrun whose workers each join their rank's cgroup before Python starts (the launcher,
    which holds no model, stays outside)."""
    wrapper = tmp / "in-cgroup.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo $$ > "{group}/rank$LOCAL_RANK/cgroup.procs" || exit 97\n'
        f'exec "{REPO / ".venv-train/bin/python"}" -m training.model_parallel "$@"\n'
    )
    wrapper.chmod(0o755)
    return [TORCHRUN, "--standalone", "--nproc_per_node", world, "--no-python", wrapper, *flags]


def test_model_over_the_budget_trains_sharded_over_4_processes(tmp_path: Path) -> None:
    state = 16 * parameter_count(GPT_CONFIGS["gpt-125m"])
    assert state > BUDGET > state / 4 + GiB  # the premise: unsharded over, sharded well under
    unsharded = ["--batch-size", 4]  # the same global batch as 4 replicas of 1
    base = memory_cgroup()
    if base is not None:  # enforced: the kernel kills a process over the budget
        with rank_cgroups(base, 1, BUDGET) as group:
            train(tmp_path, "unsharded", limited(tmp_path, group, 1, *BIG, *unsharded), expect_rc=1)
            assert oom_kills(group, 0) >= 1, (tmp_path / "unsharded.log").read_text()[-2000:]
        with rank_cgroups(base, 4, BUDGET) as group:
            sharded = train(tmp_path, "sharded", limited(tmp_path, group, 4, *BIG, "--batch-size", 1))
            assert all(oom_kills(group, rank) == 0 for rank in range(4))
    else:  # measured (see the module docstring)
        free = train(tmp_path, "unsharded", torchrun(1, *BIG, *unsharded, module="training.model_parallel"))
        assert free is not None and free["peak_memory_bytes_per_rank"][0] > BUDGET
        sharded = train(tmp_path, "sharded", torchrun(4, *BIG, "--batch-size", 1, module="training.model_parallel"))
    assert sharded is not None and sharded["layout"]["dp_shard"] == 4 and sharded["global_batch_size"] == 4
    assert all(0 < loss < 20 for _, loss in sharded["step_losses"])
    assert all(peak < BUDGET for peak in sharded["peak_memory_bytes_per_rank"])
    bound = 4 * sharded["parameters_total"] / 4 + block_bytes("gpt-125m")
    assert all(size <= bound for size in sharded["parameter_bytes_per_rank"])


def test_meta_device_init_for_models_too_big_to_build_whole(tmp_path: Path) -> None:
    """gpt-1.3b and llama-8b are created on the meta device and initialized after sharding (built
    whole, llama-8b would take 32 GB in every process). Too big to train here, so gpt-tiny takes
    that path instead (the threshold lowered to 0): it must train from its sharded initialization."""
    driver = tmp_path / "meta_init.py"
    driver.write_text("import training.model_parallel as job\njob.META_INIT_BYTES = 0\njob.main()\n")
    flags = [
        "--model",
        "gpt-tiny",
        "--seq-len",
        16,
        "--batch-size",
        8,
        "--steps",
        30,
        "--log-every",
        10,
        "--lr",
        "3e-3",
    ]
    metrics = train(tmp_path, "meta", [TORCHRUN, "--standalone", "--nproc_per_node", 4, driver, *flags, "--tp", 2])
    assert metrics is not None and metrics["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    losses = [loss for _, loss in metrics["step_losses"]]
    assert losses[-1] < losses[0] - 0.5, losses
