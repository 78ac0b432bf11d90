"""--sync local-sgd / hierarchical (training.torch.sync), as real multi-process DDP runs over gloo.

Each run checkpoints every step; a checkpoint of the periodic modes holds every replica, so the
tests read what each rank held after each step: equal to the synchronous job with --sync-every 1,
equal across ranks right after each average over every rank and different between averages,
and the same after a resume from the middle of a period.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.training.jobs import TORCHRUN, error_lines, run, start, torchrun
from tests.training.test_training_equivalence import max_difference
from training.checkpoint.files import checkpoint_path, read_checkpoint
from training.config.settings import parse_settings
from training.config.sync import HIERARCHICAL, SyncSettings
from training.errors import BadInput
from training.torch.sync import check_layout

TOLERANCE = 1e-5  # as in test_training_equivalence
SMALL = ["--model", "simple_cnn", "--image-size", "16", "--num-classes", "10", "--batch-size", "4"]
SMALL += ["--warmup-epochs", "0", "--lr", "0.05", "--backend", "ddp", "--log-every", "1"]


def state(directory: Path, step: int) -> dict[str, Any]:
    payload = read_checkpoint(checkpoint_path(directory, step)).payload
    return torch.load(io.BytesIO(payload), weights_only=True)


def numpy_weights(model: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: tensor.numpy() for name, tensor in model.items()}


def replicas(directory: Path, step: int) -> list[dict[str, np.ndarray]]:
    return [numpy_weights(replica["model"]) for replica in state(directory, step)["replicas"]]


def logged_losses(output: str) -> list[float]:
    return [float(loss) for loss in re.findall(r"step \d+/\d+ epoch \d+ loss ([0-9.]+)", output)]


def every_step(*flags: Any) -> list[Any]:
    return ["--checkpoint-every", 1, "--keep-checkpoints", 100, *SMALL, *flags]


def test_sync_every_1_equals_the_synchronous_job(tmp_path: Path) -> None:
    flags = every_step("--steps", 4, "--momentum", 0, "--weight-decay", 0)
    sync_out = run(torchrun(2, *flags, "--checkpoint-dir", tmp_path / "sync"), tmp_path / "sync.log")
    local = [*flags, "--sync", "local-sgd", "--sync-every", 1, "--checkpoint-dir", tmp_path / "local"]
    local_out = run(torchrun(2, *local), tmp_path / "local.log")
    assert "synchronisation: local-sgd every 1 steps" in local_out
    assert logged_losses(local_out) == pytest.approx(logged_losses(sync_out), abs=TOLERANCE)
    assert len(logged_losses(sync_out)) == 4
    for step in range(1, 5):
        sync_weights = numpy_weights(state(tmp_path / "sync", step)["model"])
        for rank, weights in enumerate(replicas(tmp_path / "local", step)):
            difference = max_difference(weights, sync_weights)
            assert difference < TOLERANCE, f"step {step} rank {rank}: weights differ by {difference}"
    first, last = (numpy_weights(state(tmp_path / "sync", s)["model"]) for s in (1, 4))
    assert max_difference(first, last) > 1e-3  # training moved the weights well past the tolerance


def test_local_sgd_replicas_meet_at_each_average_and_resume_exactly(tmp_path: Path) -> None:
    # One synchronous step, then averages after steps 4 and 7 (every 3), with DiLoCo's outer step;
    # a model with batch norm, whose statistics are averaged with the weights.
    flags = every_step("--steps", 7, "--sync", "local-sgd", "--sync-every", 3, "--sync-warmup-steps", 1)
    flags += ["--outer-optimizer", "nesterov", "--model", "resnet_tiny"]
    run(torchrun(2, *flags, "--checkpoint-dir", tmp_path / "whole"), tmp_path / "whole.log")
    for step in range(1, 8):
        first, second = replicas(tmp_path / "whole", step)
        if step in (1, 4, 7):
            assert max_difference(first, second) == 0, f"replicas differ right after step {step}'s average"
        else:
            assert max_difference(first, second) > 1e-4, f"replicas are equal after the local step {step}"
    # Resume from step 5, in the middle of a period: the replicas differ, the anchor is of step 4.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    checkpoint_path(resumed, 5).write_bytes(checkpoint_path(tmp_path / "whole", 5).read_bytes())
    run(torchrun(2, *flags, "--checkpoint-dir", resumed), tmp_path / "resumed.log")
    for step in (6, 7):
        again, whole = state(resumed, step), state(tmp_path / "whole", step)
        for rank in range(2):
            mine, theirs = (numpy_weights(s["replicas"][rank]["model"]) for s in (again, whole))
            assert max_difference(mine, theirs) == 0, f"resumed rank {rank} differs at step {step}"
        anchors = zip(again["sync"]["outer"]["anchor"], whole["sync"]["outer"]["anchor"], strict=True)
        assert all(torch.equal(a, b) for a, b in anchors)
        assert again["sync"]["steps_done"] == step


def test_a_run_ends_averaged_off_the_period_and_exports_the_average(tmp_path: Path) -> None:
    """Averages after steps 4 and 8; the run ends at 10, off the period. Its last step still averages,
    so the final checkpoint's replicas and the export are the mean of what the replicas trained. That
    mean is read from a run of 11 steps, whose step 10 is an ordinary local step."""
    flags = every_step("--sync", "local-sgd", "--sync-every", 4)
    run(torchrun(2, *flags, "--steps", 11, "--checkpoint-dir", tmp_path / "longer"), tmp_path / "longer.log")
    unaveraged = replicas(tmp_path / "longer", 10)
    assert max_difference(*unaveraged) > 1e-4  # step 10 is local there: the replicas differ
    mean = {name: (unaveraged[0][name] + unaveraged[1][name]) / 2 for name in unaveraged[0]}
    export = tmp_path / "model"
    args = [*flags, "--steps", 10, "--checkpoint-dir", tmp_path / "ended", "--export-dir", export]
    run(torchrun(2, *args), tmp_path / "ended.log")
    for rank, weights in enumerate(replicas(tmp_path / "ended", 10)):
        assert max_difference(weights, mean) < TOLERANCE, f"rank {rank} did not end at the replicas' mean"
    exported = torch.export.load(export / "model.pt2").state_dict
    assert max_difference({name: t.detach().numpy() for name, t in exported.items()}, mean) < TOLERANCE


def test_a_period_longer_than_the_run_is_named_and_still_ends_averaged(tmp_path: Path) -> None:
    flags = every_step("--sync", "local-sgd", "--sync-every", 50, "--steps", 3, "--checkpoint-dir", tmp_path / "c")
    output = run(torchrun(2, *flags), tmp_path / "run.log")
    assert "--sync-every 50 is longer than the run's 3 local steps: the replicas are averaged only at the end" in output
    assert max_difference(*replicas(tmp_path / "c", 2)) > 1e-4  # local steps: the replicas drifted apart
    assert max_difference(*replicas(tmp_path / "c", 3)) == 0


def test_hierarchical_averages_inside_a_node_every_step_and_across_every_h(tmp_path: Path) -> None:
    """Two torchrun agents of 2 processes each: two nodes, as torchrun numbers their ranks."""
    from dtrain.local.daemons import free_port

    port = free_port()
    flags = every_step("--steps", 4, "--sync", HIERARCHICAL, "--sync-every", 2, "--checkpoint-dir", tmp_path / "ckpt")
    agent = [TORCHRUN, "--nnodes", 2, "--nproc-per-node", 2, "--master-addr", "127.0.0.1", "--master-port", port]
    agents = [
        start([*agent, "--node-rank", node, "-m", "training.pytorch", *flags], tmp_path / f"node{node}.log")
        for node in (0, 1)
    ]
    try:
        codes = [agent.wait(timeout=180) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    for step in range(1, 5):
        ranks = replicas(tmp_path / "ckpt", step)
        assert max_difference(ranks[0], ranks[1]) == max_difference(ranks[2], ranks[3]) == 0
        across = max_difference(ranks[0], ranks[2])
        assert (across == 0) == (step % 2 == 0), f"step {step}: nodes differ by {across}"


def test_periodic_sync_refused_with_horovod_and_with_fp16_allreduce(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, expected in (
        (["--sync", "local-sgd"], "--sync local-sgd needs --backend ddp"),
        (["--backend", "ddp", "--sync", "hierarchical", "--fp16-allreduce"], "--fp16-allreduce compresses"),
        (["--backend", "ddp", "--sync-every", "4"], "--sync-every: only used with --sync local-sgd"),
        (["--backend", "ddp", "--sync", "local-sgd", "--outer-lr", "1"], "only apply to --outer-optimizer nesterov"),
        (["--backend", "ddp", "--sync", "local-sgd", "--outer-optimizer", "nesterov", "--outer-lr", "0"], "above 0"),
        (
            ["--backend", "ddp", "--sync", "local-sgd", "--outer-optimizer", "nesterov", "--outer-momentum", "1.5"],
            "--outer-momentum 1.5: must be at least 0 and below 1",
        ),
    ):
        with pytest.raises(SystemExit) as exited:
            parse_settings("pytorch", flags)
        assert exited.value.code == 2
        stderr = capsys.readouterr().err
        assert error_lines(stderr) == [stderr.strip()]
        assert expected in stderr


def test_settings_are_built_once_from_the_flags() -> None:
    flags = ["--backend", "ddp", "--sync", "local-sgd", "--outer-optimizer", "nesterov"]
    settings = parse_settings("pytorch", flags).sync
    assert settings == SyncSettings("local-sgd", 8, 0, "nesterov", 0.7, 0.9)
    assert parse_settings("pytorch", []).sync == SyncSettings()
    assert parse_settings("keras", []).sync == SyncSettings()  # TensorFlow and Keras: every step
    assert [d for d in range(12) if settings.global_average_due(d)] == [0, 8]
    late = SyncSettings(HIERARCHICAL, every=4, warmup_steps=6)
    assert [d for d in range(13) if late.global_average_due(d)] == [6, 10]


def test_hierarchical_refuses_nodes_of_different_sizes() -> None:
    check_layout([2, 2, 2, 2])
    with pytest.raises(BadInput, match="same number of processes on every node"):
        check_layout([2, 2, 1])
