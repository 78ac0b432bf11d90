"""Sharded checkpoints of the model-parallel job (training.checkpoint.sharded).

* in one process: save, prune, load, refusals, and what is never taken for a checkpoint;
* the real job (``torchrun -m training.model_parallel``, gloo): a run killed mid-way resumes on
  another world size (4 -> 2, 2 -> 1) and on the same one (2 -> 2), and onto other layouts (FSDP ->
  TP, FSDP -> pipeline, TP -> one process); the step continues and every loss after the resume
  equals an uninterrupted run's;
* a tiny test driver (tests/training/mp_checkpoint_driver.py, quick to start): a checkpoint loads
  bit for bit into TP, pipeline and 4-rank FSDP shardings; twenty SIGKILLs during saves leave no
  checkpoint that fails to load.

Loss tolerance: a resume on the same world size and layout repeats the uninterrupted run's
arithmetic (the same bits are loaded, then the same reductions run): 1e-7 relative, one float32
ulp of a loss near 5.5 (measured: identical). Another world size or layout sums in another order
(reduce-scatter over 4 ranks instead of 2, TP's partial sums, a pipeline's microbatches), which
can change float32 results in the last bits: the issue's 1e-5 relative (measured: at most 4.4e-8
over these steps). What the tolerance must catch: a resume that loads the weights but loses
AdamW's moments changes the losses of the following steps by 1.1e-4 to 2.9e-4 relative (measured
by breaking the load on purpose); that is why every comparison covers at least two steps after
the resume (the first step's loss is computed before the first optimizer step).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.polling import wait_for
from tests.training import mp_checkpoint_driver as driver
from tests.training.jobs import TORCHRUN, kill_tree, run, start, worker_pid
from training.checkpoint.sharded import COMMIT_MARKER, ShardedCheckpoints, checkpoint_name, read_marker
from training.errors import CheckpointRefused, OutputPathError

DRIVER = "tests.training.mp_checkpoint_driver"
JOB = "training.model_parallel"
GLOBAL_BATCH = 4  # sequences per step in every layout: 4 ranks x 1, 2 x 2, 1 x 4, or one TP/PP group x 4
SEQ_LEN = 32
REFERENCE_STEPS = 30
SAME_LAYOUT_RTOL = 1e-7
OTHER_LAYOUT_RTOL = 1e-5
KILLS = 20


def torchrun_module(nproc: int, module: str, *args: Any) -> list[Any]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", nproc, "-m", module, *args]


def job(nproc: int, ckpt: Path, steps: int, *extra: Any, replicas: int | None = None) -> list[Any]:
    """The real job on gpt-tiny; ``replicas``: data-parallel replicas (default: every rank)."""
    per_replica = GLOBAL_BATCH // (replicas or nproc)
    return torchrun_module(
        nproc, JOB, "--model", "gpt-tiny", "--seq-len", SEQ_LEN, "--batch-size", per_replica, "--steps", steps,
        "--log-every", 1, "--timing-warmup-steps", 0, "--checkpoint-dir", ckpt, "--checkpoint-every", 2, *extra,
    )  # fmt: skip


def step_of(path: Path | None) -> int:
    return 0 if path is None else int(path.name.removeprefix("step-"))


def newest_step(ckpt: Path) -> int:
    return step_of(ShardedCheckpoints(ckpt).latest())


def kill_after_checkpoint(cmd: list[Any], ckpt: Path, log: Path, at_least: int) -> int:
    """Start ``cmd``, SIGKILL every process of it once a checkpoint of step >= ``at_least`` is
    committed, and return the newest committed step; fail if the run ended on its own first."""
    proc = start(cmd, log)
    try:
        wait_for(
            lambda: newest_step(ckpt) >= at_least or proc.poll() is not None, 180, f"a checkpoint of step {at_least}"
        )
        assert proc.poll() is None, f"the run ended before it was killed:\n{log.read_text()[-3000:]}"
    finally:
        kill_tree(proc)
    return newest_step(ckpt)


def losses_of(metrics_path: Path, resumed_from: int | None) -> dict[int, float]:
    """The run's loss at every step, after checking where it resumed and that no step is missing."""
    metrics = json.loads(metrics_path.read_text())
    assert metrics["resumed_from_step"] == resumed_from
    losses = {step: loss for step, loss in metrics["step_losses"]}
    assert sorted(losses) == list(range((resumed_from or 0) + 1, metrics["steps"] + 1)), "the steps do not continue"
    return losses


def assert_losses_match(found: dict[int, float], reference: dict[int, float], rtol: float) -> None:
    for step, loss in found.items():
        assert loss == pytest.approx(reference[step], rel=rtol), f"step {step}: {loss} != reference {reference[step]}"


def resume(nproc: int, ckpt: Path, steps: int, tmp: Path, name: str, *extra: Any, replicas: int | None = None) -> dict:
    """Run the job to ``steps`` from the newest checkpoint in ``ckpt``; its losses after the resume."""
    resumed_from = newest_step(ckpt)
    metrics = tmp / f"{name}.json"
    run(job(nproc, ckpt, steps, "--metrics-json", metrics, *extra, replicas=replicas), tmp / f"{name}.log")
    return losses_of(metrics, resumed_from)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """An uninterrupted FSDP run on 2 ranks: the loss of every step."""
    tmp = tmp_path_factory.mktemp("reference")
    run(job(2, tmp / "ckpt", REFERENCE_STEPS, "--metrics-json", tmp / "m.json"), tmp / "reference.log")
    return losses_of(tmp / "m.json", None)


def test_killed_run_resumes_on_other_and_same_world_sizes(tmp_path: Path, reference: dict[int, float]) -> None:
    ckpt = tmp_path / "ckpt"
    # 4 ranks, killed mid-way, resume on 2.
    killed = kill_after_checkpoint(job(4, ckpt, 1000), ckpt, tmp_path / "killed4.log", at_least=2)
    losses = resume(2, ckpt, killed + 3, tmp_path, "resumed2")
    assert_losses_match(losses, reference, OTHER_LAYOUT_RTOL)
    # 2 ranks, killed mid-way; the same checkpoints resume on 2 ranks, and (a copy) on 1.
    killed = kill_after_checkpoint(job(2, ckpt, 1000), ckpt, tmp_path / "killed2.log", at_least=killed + 5)
    assert killed + 4 <= REFERENCE_STEPS
    shutil.copytree(ckpt, tmp_path / "copy")
    assert_losses_match(resume(2, ckpt, killed + 4, tmp_path, "same2"), reference, SAME_LAYOUT_RTOL)
    assert_losses_match(resume(1, tmp_path / "copy", killed + 4, tmp_path, "one"), reference, OTHER_LAYOUT_RTOL)


def test_checkpoint_resumes_onto_tensor_and_pipeline_parallel_layouts(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    ckpt = tmp_path / "ckpt"
    run(job(2, ckpt, 4), tmp_path / "fsdp.log")  # FSDP over 2 ranks, checkpoint of step 4
    shutil.copytree(ckpt, tmp_path / "pp")
    tp = resume(2, ckpt, 6, tmp_path, "tp", "--tp", 2, replicas=1)
    assert_losses_match(tp, reference, OTHER_LAYOUT_RTOL)
    pp = resume(2, tmp_path / "pp", 6, tmp_path, "pp", "--pp", 2, "--pp-schedule", "gpipe", replicas=1)
    assert_losses_match(pp, reference, OTHER_LAYOUT_RTOL)
    # And back: the TP run's checkpoint (step 6) on one process.
    assert_losses_match(resume(1, ckpt, 8, tmp_path, "tp-to-one"), reference, OTHER_LAYOUT_RTOL)


def test_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(driver_cmd(1, ckpt, "--steps", 1), tmp_path / "tinynet.log")
    # torchrun exits 1 whenever a worker fails; the worker's own status is the table's 2 (bad input).
    output = run(job(1, ckpt, 2), tmp_path / "gpt.log", expect_rc=1)
    assert re.search(r"exitcode\s*: 2 ", output), output[-3000:]
    assert len([line for line in output.splitlines() if line.startswith("error: ")]) == 1
    # Refused by the job's expectation (model name) or, without one, by the shapes: either way, one line.
    refusal = (
        f"error: checkpoint {ckpt / checkpoint_name(1)} (does not fit this model|was written with model 'tinynet')"
    )
    assert re.search(refusal, output), output[-3000:]


# --- The test driver: exact state in other shardings, and kills during saves -----------------


def driver_cmd(nproc: int, ckpt: Path, *args: Any) -> list[Any]:
    return torchrun_module(nproc, DRIVER, "--checkpoint-dir", ckpt, *args)


def load_in_process(path: Path) -> tuple[driver.TinyNet, torch.optim.Optimizer, dict]:
    """Load a driver checkpoint into one plain TinyNet and its AdamW, here (no process group)."""
    model = driver.build(seed=1)  # other weights than the checkpoint's, so a load that does nothing shows
    optimizer = torch.optim.AdamW(model.parameters(), lr=driver.LR, weight_decay=driver.WEIGHT_DECAY)
    extra = ShardedCheckpoints(path.parent).load(path, [model], [optimizer], expect={"model": driver.MODEL})
    return model, optimizer, extra


def full_state_in_process(path: Path) -> dict[str, Any]:
    model, optimizer, _ = load_in_process(path)
    return driver.full_state(model, optimizer)


def test_checkpoint_loads_exactly_into_other_shardings(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(driver_cmd(2, ckpt, "--steps", 3), tmp_path / "save.log")  # FSDP over 2 ranks
    expected = full_state_in_process(ShardedCheckpoints(ckpt).latest())
    assert any(key.endswith(".exp_avg_sq") for key in expected)
    for nproc, layout in ((2, "tp"), (2, "pp"), (4, "fsdp")):
        dump = tmp_path / f"{layout}{nproc}.pt"
        run(driver_cmd(nproc, ckpt, "--mode", "verify", "--layout", layout, "--dump", dump), tmp_path / f"{layout}.log")
        found = torch.load(dump, weights_only=False)
        assert found["extra"]["step"] == 3
        assert sorted(found["state"]) == sorted(expected), layout
        for key, value in expected.items():
            same = torch.equal(found["state"][key], value) if torch.is_tensor(value) else found["state"][key] == value
            assert same, f"{layout}: {key} differs"
        if layout == "pp":  # each stage asked for its own layers only
            first, last = found["keys_per_rank"]
            assert "model.layers.0.fc1.weight" in first and "model.layers.0.fc1.weight" not in last
            assert "model.head.weight" in last and "model.head.weight" not in first


def check_every_checkpoint_loads(ckpt: Path) -> list[int]:
    """Every checkpoint listed as complete loads, holds the state of its step (the digest the
    writer recorded), and none is a temporary; return their steps."""
    steps = []
    for path in ShardedCheckpoints(ckpt).committed():
        assert path.name == checkpoint_name(step_of(path)) and not path.name.startswith(".")
        model, optimizer, extra = load_in_process(path)
        assert extra["step"] == step_of(path) == read_marker(path)["step"]
        found = driver.digest(model, optimizer)
        assert found["param_sum"] == pytest.approx(extra["param_sum"], rel=1e-9, abs=1e-9), path
        assert found["exp_avg_sq_sum"] == pytest.approx(extra["exp_avg_sq_sum"], rel=1e-9, abs=1e-12), path
        steps.append(step_of(path))
    return steps


def kill(proc: subprocess.Popen, pids: list[int], victims: str) -> None:
    """SIGKILL ``victims`` ("all" workers at once, or one "rank0"/"rank1"), then the rest."""
    chosen = pids if victims == "all" else [pids[int(victims[-1])]]
    for pid in chosen:
        psutil.Process(pid).kill()
    if victims != "all":  # torchrun then stops the other worker itself (or it fails on the dead peer)
        with contextlib.suppress(subprocess.TimeoutExpired):  # kill_tree below ends whatever is left
            proc.wait(timeout=60)
    kill_tree(proc)


def test_twenty_kills_during_saves_leave_no_checkpoint_that_fails_to_load(tmp_path: Path) -> None:
    """Each attempt resumes from the newest checkpoint, saves every step, and is SIGKILLed at a
    random moment after its first save: all workers at once, or only the writer of the commit
    (rank 0), or only rank 1. Saves take most of each step, so most kills land inside one."""
    ckpt, rng = tmp_path / "ckpt", random.Random(10)
    cmd = driver_cmd(2, ckpt, "--steps", 1_000_000, "--checkpoint-every", 1, "--keep", 3)
    landed: Counter[str] = Counter()
    for attempt in range(KILLS):
        before = newest_step(ckpt)
        log = tmp_path / f"attempt{attempt}.log"
        proc = start(cmd, log)
        try:
            pids = [worker_pid(proc, rank, DRIVER) for rank in (0, 1)]
            wait_for(lambda b=before: newest_step(ckpt) > b, 120, f"attempt {attempt}'s first save")
            time.sleep(rng.uniform(0, 0.3))  # a few steps: a save takes most of each (about 3/4 measured)
            kill(proc, pids, ("all", "rank0", "rank1")[attempt % 3])
        finally:
            kill_tree(proc)
        output = log.read_text()
        if before:
            assert f"resumed from step {before} ({checkpoint_name(before)})" in output
        hidden = {path.name.split(".")[2].split("-")[0] for path in ckpt.glob(".step-*")}
        landed["inside a save" if "tmp" in hidden else "between saves"] += 1
        assert check_every_checkpoint_loads(ckpt)
    print(f"where the {KILLS} kills landed: {dict(landed)}")  # shown with pytest -s
    assert landed["inside a save"] >= KILLS // 4, f"too few kills landed inside a save: {dict(landed)}"

    # A last run finishes: it resumes, removes what the kills left, and keeps the newest three.
    final = newest_step(ckpt) + 2
    run(driver_cmd(2, ckpt, "--steps", final, "--checkpoint-every", 1, "--keep", 3), tmp_path / "last.log")
    assert not list(ckpt.glob(".step-*"))
    assert check_every_checkpoint_loads(ckpt) == [final - 2, final - 1, final]


# --- One process, no process group ------------------------------------------------------------


def trained(seed: int = 0) -> tuple[driver.TinyNet, torch.optim.Optimizer]:
    model = driver.build(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=driver.LR, weight_decay=driver.WEIGHT_DECAY)
    x, y = driver.global_batch(seed, 1, 8)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return model, optimizer


def test_save_prunes_and_load_restores_model_optimizer_and_extra(tmp_path: Path) -> None:
    model, optimizer = trained()
    ckpts = ShardedCheckpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        path = ckpts.save(step, [model], [optimizer], {"model": driver.MODEL, "layout": Path("x")})
    assert path == tmp_path / "step-0000000003" == ckpts.latest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000002", "step-0000000003"]
    marker = read_marker(path)
    assert (marker["step"], marker["world_size"], marker["extra"]["layout"]) == (3, 1, "x")
    loaded, loaded_optimizer, extra = load_in_process(path)
    assert extra == {"model": driver.MODEL, "layout": "x", "step": 3, "world_size": 1}
    for key, value in driver.full_state(model, optimizer).items():
        found = driver.full_state(loaded, loaded_optimizer)[key]
        assert torch.equal(found, value) if torch.is_tensor(value) else found == value, key


def test_hidden_and_unmarked_directories_are_never_taken_and_leftovers_go(tmp_path: Path) -> None:
    model, optimizer = trained()
    ckpts = ShardedCheckpoints(tmp_path)
    good = ckpts.save(1, [model], [optimizer], {"model": driver.MODEL})
    # Complete-looking copies under a temporary's or a deletion's name, and a final name without marker.
    shutil.copytree(good, tmp_path / ".step-0000000009.tmp-abc")
    shutil.copytree(good, tmp_path / ".step-0000000008.old-abc")
    shutil.copytree(good, tmp_path / "step-0000000007")
    (tmp_path / "step-0000000007" / COMMIT_MARKER).unlink()
    assert ckpts.committed() == [good] and ckpts.latest() == good
    ckpts.save(2, [model], [optimizer], {"model": driver.MODEL})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000001", "step-0000000002", "step-0000000007"]
    with pytest.raises(CheckpointRefused, match="is not a complete checkpoint"):
        load_in_process(tmp_path / "step-0000000007")


class Cut(BaseException):
    """The save stops here, as if the process were killed (BaseException: nothing catches it)."""


def cut_at(monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    """Make the ``cut``-th file-system operation (mkdir, write's fsync, rename, unlink...) stop the process."""
    calls = 0

    def wrap(real: Any) -> Any:
        def operation(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == cut:
                raise Cut
            return real(*args, **kwargs)

        return operation

    for name in ("mkdir", "fsync", "rename", "replace", "unlink", "rmdir"):
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))


def test_a_save_cut_short_at_any_file_operation_leaves_only_complete_checkpoints(tmp_path: Path) -> None:
    """Deterministic companion of the kill test: stop a save at each of its file operations in
    turn (writing shards and index, the marker, the rename, pruning), from the same starting point."""
    model, optimizer = trained()
    extra = {"model": driver.MODEL, **driver.digest(model, optimizer)}
    pristine = tmp_path / "pristine"
    for step in (1, 2):
        ShardedCheckpoints(pristine, keep=2).save(step, [model], [optimizer], extra)
    cut = 0
    while True:
        cut += 1
        ckpt = tmp_path / f"cut{cut}"
        shutil.copytree(pristine, ckpt)
        with pytest.MonkeyPatch.context() as monkeypatch:
            cut_at(monkeypatch, cut)
            try:
                ShardedCheckpoints(ckpt, keep=2).save(3, [model], [optimizer], extra)
                finished = True
            except Cut:
                finished = False
            except OutputPathError as exc:  # DCP catches the cut inside its writer and reports it
                assert "Cut" in str(exc), exc
                finished = False
        steps = check_every_checkpoint_loads(ckpt)
        assert steps in ([1, 2], [1, 2, 3], [2, 3]), f"cut at operation {cut}: {steps}"
        if finished:
            break
    assert steps == [2, 3]
    assert cut > 10, f"a save took only {cut - 1} file operations: the cuts did not reach it"


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    model, optimizer = trained()
    ckpts = ShardedCheckpoints(tmp_path)
    ckpts.save(1, [model], [optimizer], {"model": driver.MODEL, "run": "first"})
    ckpts.save(1, [model], [optimizer], {"model": driver.MODEL, "run": "second"})
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000001"]
    assert read_marker(ckpts.latest())["extra"]["run"] == "second"


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    model, optimizer = trained()
    ckpts = ShardedCheckpoints(tmp_path)
    path = ckpts.save(1, [model], [optimizer], {"model": driver.MODEL})
    with pytest.raises(CheckpointRefused, match=r"was written with model 'tinynet', but this run has model 'gpt'"):
        ckpts.load(path, [model], [optimizer], expect={"model": "gpt"})
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointRefused, match=r"does not fit this model: 2 of this model's entries are not in it"):
        ckpts.load(path, [other], [])
    wider = driver.build(0)
    wider.head = torch.nn.Linear(driver.DIM, driver.CLASSES + 1)
    with pytest.raises(CheckpointRefused, match=r"model.head.weight saved \[5, 24\], here \[6, 24\]"):
        ckpts.load(path, [wider], [])
    (path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointRefused, match=r"cannot read checkpoint .*: delete it to resume from the one before"):
        ckpts.load(path, [model], [optimizer])


def test_a_save_that_cannot_be_written_is_one_clear_error(tmp_path: Path) -> None:
    model, optimizer = trained()
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OutputPathError, match=r"cannot write --checkpoint-dir .*file: a part of the path is a file"):
        ShardedCheckpoints(tmp_path / "file").save(1, [model], [optimizer], {})
    with pytest.raises(TypeError, match="object is not JSON-serializable"):
        ShardedCheckpoints(tmp_path / "ckpt").save(1, [model], [optimizer], {"what": object()})
    assert not (tmp_path / "ckpt").exists()


def test_pipeline_parts_merge_by_name_and_clashes_are_refused(tmp_path: Path) -> None:
    model, optimizer = trained()
    first, second = driver.build(0), driver.build(0)
    for i in ("2", "3"):
        del first.layers[i]
    for i in ("0", "1"):
        del second.layers[i]
    first.head, second.inp = None, None
    ckpts = ShardedCheckpoints(tmp_path)
    path = ckpts.save(1, [model], [optimizer], {"model": driver.MODEL})
    parts = [first, second]
    optimizers = [torch.optim.AdamW(part.parameters()) for part in parts]
    ckpts.load(path, parts, optimizers)  # two stages of one rank (interleaved schedules) load from one checkpoint
    assert torch.equal(second.layers["3"].fc1.weight, model.layers["3"].fc1.weight)
    assert optimizers[1].state[second.head.weight]["exp_avg"].equal(optimizer.state[model.head.weight]["exp_avg"])
    # The moments are the checkpoint's; the settings stay this run's (AdamW's default lr, not the writer's).
    assert optimizers[0].param_groups[0]["lr"] == 1e-3 != driver.LR
    with pytest.raises(ValueError, match=r"model\.inp\.weight is in two model parts"):
        ckpts.save(2, [model, driver.build(0)], [], {})
