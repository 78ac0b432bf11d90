"""In-process tests of the framework-neutral pieces: schedule, checkpoints, data, metrics, loop."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.training.jobs import make_imagenet
from training.checkpoint.files import (
    Checkpoint,
    CheckpointDir,
    CorruptCheckpoint,
    Fingerprint,
    checkpoint_path,
    read_checkpoint,
    write_checkpoint,
)
from training.checkpoint.writer import finish_writes
from training.config.models import IMAGE_MODELS
from training.config.settings import parse_settings
from training.data import imagenet as data
from training.errors import BadInput, CheckpointRefused, OutputPathError, Preempted
from training.run import metrics, outputs
from training.run.loop import TrainingRun, resume
from training.run.schedule import learning_rate
from training.world import preemption
from training.world.distributed import FAILURE_TIMEOUTS, agree, set_failure_timeouts

# --- LR schedule -------------------------------------------------------------------------


def test_lr_warms_up_from_base_to_scaled_then_decays() -> None:
    lr = lambda step: learning_rate(step, 100, 0.1, 8, 5, (30, 60, 80))  # noqa: E731
    assert lr(0) == pytest.approx(0.1)  # one worker's LR at the start
    assert lr(250) == pytest.approx(0.1 + 0.7 * 0.5)  # half way through warmup
    assert lr(500) == pytest.approx(0.8)  # linear scaling: base x 8 workers
    assert lr(2999) == pytest.approx(0.8)
    assert lr(3000) == pytest.approx(0.08)
    assert lr(6000) == pytest.approx(0.008)
    assert lr(8000) == pytest.approx(0.0008)


def test_lr_without_warmup_is_scaled_from_the_first_step() -> None:
    assert learning_rate(0, 10, 0.1, 4, 0) == pytest.approx(0.4)


# --- checkpoints ---------------------------------------------------------------------------

PRINT = Fingerprint.of("pytorch", "resnet_tiny", 10, [("fc.weight", (10, 64))])


def test_checkpoint_round_trip_and_damage_detection(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, 7, PRINT, b"payload" * 100)
    assert path == checkpoint_path(tmp_path, 7)
    assert read_checkpoint(path) == Checkpoint(path, 7, PRINT, b"payload" * 100)
    whole = path.read_bytes()
    for damaged, reason in [
        (whole[:-1], "after the header, the header says"),
        (whole[:10], "shorter than the header"),
        (b"NOTACKPT" + whole[8:], "bad magic"),
        (b"HVDCKPT1" + whole[8:], "older version of these jobs"),
        (whole[:-1] + bytes([whole[-1] ^ 1]), "checksum"),
    ]:
        path.write_bytes(damaged)
        with pytest.raises(CorruptCheckpoint, match=reason):
            read_checkpoint(path)


def test_checkpoint_renamed_to_another_step_is_rejected(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 3, PRINT, b"x").rename(checkpoint_path(tmp_path, 4))
    with pytest.raises(CorruptCheckpoint, match="header says step 3"):
        read_checkpoint(checkpoint_path(tmp_path, 4))


def test_corrupt_newest_checkpoint_falls_back_to_the_older_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints = CheckpointDir(tmp_path, keep=3)
    for step in (10, 20, 30):
        checkpoints.save(step, PRINT, f"state {step}".encode())
    newest = checkpoint_path(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING):
        found = checkpoints.load_latest(PRINT, bytes.decode)
    assert found is not None and (found.step, found.payload) == (20, b"state 20")
    assert f"checkpoint {newest} is unusable" in caplog.text
    assert f"falling back to the older {checkpoint_path(tmp_path, 20)}" in caplog.text


def test_checkpoint_that_does_not_decode_falls_back(tmp_path: Path) -> None:
    checkpoints = CheckpointDir(tmp_path, keep=3)
    checkpoints.save(1, PRINT, b'{"ok": 1}')
    checkpoints.save(2, PRINT, b"not json")
    found = checkpoints.load_latest(PRINT, json.loads)
    assert found is not None and found.payload == b'{"ok": 1}'


def test_an_empty_or_absent_directory_means_a_fresh_start(tmp_path: Path) -> None:
    assert CheckpointDir(tmp_path / "absent").load_latest(PRINT, bytes.decode) is None
    assert CheckpointDir(tmp_path).load_latest(PRINT, bytes.decode) is None


def test_only_damaged_checkpoints_are_refused_unless_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint_path(tmp_path, 5).write_bytes(b"garbage" * 20)
    with pytest.raises(
        CheckpointRefused, match=r"no usable checkpoint in .*ckpt-0000000005\.ckpt: .*bad magic"
    ) as refused:
        CheckpointDir(tmp_path).load_latest(PRINT, bytes.decode)
    assert "--ignore-bad-checkpoints" in str(refused.value)
    assert "falling back" not in caplog.text  # there is nothing to fall back to
    with caplog.at_level(logging.WARNING):
        assert CheckpointDir(tmp_path).load_latest(PRINT, bytes.decode, ignore_bad=True) is None
    assert "starting from step 0" in caplog.text and "falling back" not in caplog.text
    # Moved aside, so they cannot shadow the checkpoints of the fresh run.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000005.ckpt.corrupt"]


def test_a_checkpoint_of_another_model_is_refused_not_skipped(tmp_path: Path) -> None:
    checkpoints = CheckpointDir(tmp_path)
    checkpoints.save(1, PRINT, b"older")
    checkpoints.save(2, Fingerprint.of("keras", "resnet50", 1000, [(7, 7, 3, 64)]), b"newer")
    with pytest.raises(CheckpointRefused) as refused:
        checkpoints.load_latest(PRINT, bytes.decode)
    message = str(refused.value)
    assert f"checkpoint {checkpoint_path(tmp_path, 2)} holds keras resnet50 with 1000 classes" in message
    assert "this run is pytorch resnet_tiny with 10 classes" in message
    assert "use another --checkpoint-dir, or delete" in message


def test_save_keeps_the_newest_and_stale_temporaries_are_removed(tmp_path: Path) -> None:
    checkpoints = CheckpointDir(tmp_path, keep=2)
    for step in range(1, 6):
        checkpoints.save(step, PRINT, b"x")
    assert checkpoints.steps() == [4, 5]
    stale = tmp_path / ".ckpt-0000000006.tmp-12345"
    stale.write_bytes(b"half a checkpoint")
    assert checkpoints.steps() == [4, 5]  # temporaries are never candidates
    checkpoints.remove_stale_temporaries()
    assert not stale.exists()


# --- data ----------------------------------------------------------------------------------


def test_missing_and_empty_data_dirs_are_named(tmp_path: Path) -> None:
    with pytest.raises(data.DataDirError, match=f"data directory {tmp_path / 'nope'} does not exist"):
        data.load_imagenet(tmp_path / "nope", 32, 0)
    with pytest.raises(data.DataDirError, match=f"{tmp_path / 'train'} does not exist"):
        data.load_imagenet(tmp_path, 32, 0)
    (tmp_path / "train").mkdir()
    with pytest.raises(data.DataDirError, match=f"{tmp_path / 'train'} contains no class folders"):
        data.load_imagenet(tmp_path, 32, 0)


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_class_folder_is_refused(tmp_path: Path, split: str) -> None:
    root = make_imagenet(tmp_path, classes=2, train_per_class=1, val_per_class=1, corrupt=0)
    for image in (root / split / "n00000001").iterdir():
        image.unlink()
    with pytest.raises(data.DataDirError, match=f"class folder {root / split / 'n00000001'} contains no images"):
        data.load_imagenet(root, 32, 0)


def test_a_run_of_unreadable_images_is_an_error_not_an_endless_search(tmp_path: Path) -> None:
    root = make_imagenet(
        tmp_path, classes=1, train_per_class=data.MAX_UNREADABLE_IN_A_ROW + 5, val_per_class=1, corrupt=0
    )
    train, _ = data.load_imagenet(root, 16, 0)
    for path in train.paths[: data.MAX_UNREADABLE_IN_A_ROW]:
        Path(path).write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(data.DataDirError, match=f"{data.MAX_UNREADABLE_IN_A_ROW} images in a row under"):
        train[0, 0]
    assert train[1, 0][2] == data.MAX_UNREADABLE_IN_A_ROW - 1  # one readable file within reach: skipped, counted


def test_val_classes_must_exist_in_train(tmp_path: Path) -> None:
    root = make_imagenet(tmp_path, classes=2, train_per_class=1, val_per_class=1, corrupt=0)
    (root / "val" / "n99999999").mkdir()
    with pytest.raises(data.DataDirError, match="n99999999"):
        data.load_imagenet(root, 32, 0)


def test_imagenet_index_decode_and_corrupt_file_skip(tmp_path: Path) -> None:
    root = make_imagenet(tmp_path, classes=3, train_per_class=4, val_per_class=2, corrupt=1)
    train, val = data.load_imagenet(root, 24, seed=3)
    assert val is not None
    assert (len(train), len(val), train.classes) == (12, 6, val.classes)
    assert sorted(set(train.labels.tolist())) == [0, 1, 2]
    corrupt = train.paths.index(str(root / "train" / "n00000000" / "n00000000_0.JPEG"))
    image, label, skipped = train[corrupt, 0]
    assert (image.shape, image.dtype, skipped, label) == ((24, 24, 3), np.uint8, 1, 0)
    assert np.array_equal(image, train[corrupt + 1, 0][0])  # the next file stands in
    a, b = train[corrupt + 1, 5][0], train[corrupt + 1, 5][0]
    assert np.array_equal(a, b)  # augmentation is a function of (seed, epoch, index)
    assert val[0, data.VAL_EPOCH][0].shape == (24, 24, 3)


def test_random_resized_crop_box_stays_inside_the_image() -> None:
    rng = np.random.default_rng(0)
    for width, height in [(500, 375), (20, 200), (300, 30), (1, 1)]:
        for _ in range(50):
            left, top, w, h = data.random_resized_crop_box(width, height, rng)
            assert left >= 0 and top >= 0 and w > 0 and h > 0
            assert left + w <= width and top + h <= height


def test_train_keys_shard_disjointly_with_equal_step_counts() -> None:
    n, world, batch, per_epoch = 103, 4, 5, 5
    shards = [list(data.train_keys(n, rank, world, batch, 7, per_epoch, 0, 2 * per_epoch)) for rank in range(world)]
    assert {len(s) for s in shards} == {2 * per_epoch}
    for epoch in range(2):
        seen = [i for s in shards for b in s[epoch * per_epoch : (epoch + 1) * per_epoch] for i, e in b]
        assert len(seen) == len(set(seen)) == world * per_epoch * batch  # no image twice per epoch
    assert shards[0][0] != shards[0][per_epoch]  # a new order each epoch


def test_train_keys_resume_mid_epoch_continues_the_same_order() -> None:
    full = list(data.train_keys(50, 1, 2, 4, 0, 6, 0, 12))
    assert list(data.train_keys(50, 1, 2, 4, 0, 6, 4, 12)) == full[4:]


def test_val_keys_cover_every_image_once() -> None:
    keys = [i for rank in range(3) for b in data.val_keys(10, rank, 3, 2) for i, _ in b]
    assert sorted(keys) == list(range(10))


def test_steps_per_epoch_is_equal_for_all_ranks() -> None:
    assert data.steps_per_epoch(1000, 3, 10) == 33
    with pytest.raises(data.DataDirError, match="fewer than one batch"):
        data.steps_per_epoch(5, 2, 4)


def test_synthetic_batches_of_two_ranks_equal_one_double_batch() -> None:
    one = data.synthetic_batch(1, 0, 6, 8, 10)
    two = [data.synthetic_batch(1, rank, 3, 8, 10) for rank in range(2)]
    assert np.array_equal(one[0], np.concatenate([two[0][0], two[1][0]]))
    assert np.array_equal(one[1], np.concatenate([two[0][1], two[1][1]]))


# --- metrics ---------------------------------------------------------------------------------


def test_throughput_is_global_batch_over_the_slowest_rank() -> None:
    # Rank 0 took 1 s for 10 steps, rank 1 took 2 s: the job ran at rank 1's pace.
    images_per_sec, per_worker = metrics.throughput(64, 10, [1.0, 2.0])
    assert images_per_sec == pytest.approx(320.0)  # not rank 0's 640 x 2 workers
    assert per_worker == pytest.approx(160.0)
    assert metrics.throughput(64, 0, [0.0, 0.0]) == (None, None)


def test_step_timer_leaves_out_warmup_steps_and_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 10.0, 11.0, 12.0, 12.5, 13.5, 100.0, 101.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = metrics.StepTimer(excluded=1)
    timer.step_done()  # t=0: the excluded step ends, timing starts
    timer.step_done()  # t=10: 10 s
    timer.pause()  # t=11
    timer.resume()  # t=12: 1 s paused
    timer.step_done()  # t=12.5: 2.5 s, 1 s of it paused
    timer.step_done()  # t=13.5: 1 s
    timer.pause()  # t=100: a pause after the last step counts for nothing
    timer.resume()  # t=101
    assert timer.measured_steps == 3
    assert timer.elapsed == pytest.approx(12.5)


def test_metrics_schema_is_enforced(tmp_path: Path) -> None:
    good = dict.fromkeys(metrics.METRIC_KEYS, 1.0)
    metrics.write_metrics(tmp_path / "m.json", good)
    assert json.loads((tmp_path / "m.json").read_text()) == good
    with pytest.raises(ValueError, match="schema"):
        metrics.validate_metrics({k: v for k, v in good.items() if k != "device"})
    with pytest.raises(ValueError, match="final_loss is nan"):
        metrics.validate_metrics({**good, "final_loss": float("nan")})


# --- flags and failure settings ---------------------------------------------------------------


def test_flags_are_validated() -> None:
    with pytest.raises(SystemExit):
        parse_settings("pytorch", ["--data", "imagenet"])  # needs --data-dir
    with pytest.raises(SystemExit):
        parse_settings("keras", ["--backend", "ddp"])  # PyTorch only
    with pytest.raises(SystemExit):
        parse_settings("tensorflow", ["--decode", "gpu"])  # PyTorch only
    with pytest.raises(SystemExit):
        parse_settings("pytorch", ["--decode", "gpu"])  # synthetic data: nothing to decode
    assert parse_settings("pytorch", ["--decode", "auto"]).decode == "auto"
    with pytest.raises(SystemExit):
        parse_settings("tensorflow", ["--batch-size", "0"])
    with pytest.raises(SystemExit):
        parse_settings("tensorflow", ["--lr-decay-epochs", "60,30"])
    settings = parse_settings("pytorch", ["--lr-decay-epochs", "2,4"])
    chosen = (settings.model, settings.image_size, settings.backend, settings.optimizer.lr_decay_epochs)
    assert chosen == ("resnet50", 224, "horovod", (2.0, 4.0))


def test_model_names_match_the_builders() -> None:
    from training.torch.models import MODELS as TORCH_MODELS

    assert tuple(TORCH_MODELS) == IMAGE_MODELS


def test_failure_timeouts_fill_in_defaults_but_keep_user_values() -> None:
    env = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"}
    effective = set_failure_timeouts(env)
    assert effective["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "300"
    assert effective["HOROVOD_STALL_CHECK_TIME_SECONDS"] == FAILURE_TIMEOUTS["HOROVOD_STALL_CHECK_TIME_SECONDS"]
    assert env.keys() == FAILURE_TIMEOUTS.keys()


def test_output_paths_are_checked_up_front(tmp_path: Path) -> None:
    def check(*flags: str, min_free_mb: str = "1") -> None:
        outputs.check_output_paths(parse_settings("pytorch", list(flags)), {outputs.MIN_FREE_ENV: min_free_mb})

    check("--checkpoint-dir", str(tmp_path / "new" / "ckpt"), "--metrics-json", str(tmp_path / "new" / "m.json"))
    assert (tmp_path / "new" / "ckpt").is_dir() and list((tmp_path / "new").iterdir()) == [tmp_path / "new" / "ckpt"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputPathError, match=f"cannot write --checkpoint-dir {blocker / 'ckpt'}: a part of the path"):
        check("--checkpoint-dir", str(blocker / "ckpt"))
    with pytest.raises(OutputPathError, match=f"--metrics-json {tmp_path} is a directory"):
        check("--metrics-json", str(tmp_path))
    with pytest.raises(OutputPathError, match=r"only \d+ MiB free, at least 1073741824 MiB needed"):
        check("--checkpoint-dir", str(tmp_path), min_free_mb=str(2**30))
    with pytest.raises(BadInput, match=f"{outputs.MIN_FREE_ENV}='lots'"):
        check("--checkpoint-dir", str(tmp_path), min_free_mb="lots")


# --- the step loop's bookkeeping (one process) -------------------------------------------------


class OneProcess:
    backend, rank, size, local_rank, local_size = "test", 0, 1, 0, 1

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def start_vote(self, flag: bool) -> Callable[[], bool]:
        return lambda: flag


def test_agree_raises_the_first_refusal_on_every_rank() -> None:
    class SecondOfTwo(OneProcess):
        rank, size = 1, 2

        def allgather_object(self, obj: Any) -> list[Any]:
            return [None, obj]  # rank 0 found nothing wrong

    def refuse() -> None:
        raise data.DataDirError("data directory /x does not exist")

    assert agree(OneProcess(), lambda: 7) == 7
    with pytest.raises(data.DataDirError, match=r"^rank 1: data directory /x does not exist$") as refused:
        agree(SecondOfTwo(), refuse)
    assert refused.value.every_rank


def run_steps(
    tmp_path: Path, flags: list[str], evaluate: Any = None, checkpoint_dir: Path | None = None, per_epoch: int = 4
) -> tuple[dict[str, Any], list[int]]:
    """A run of --steps steps (flags), in epochs of per_epoch steps."""
    settings = parse_settings("pytorch", ["--checkpoint-dir", str(checkpoint_dir or tmp_path / "ckpt"), *flags])
    dist = OneProcess()
    start, state = resume(settings, dist, PRINT, settings.steps, bytes.decode)
    assert state == (f"{start}" if start else None)  # what save_state below wrote
    run = TrainingRun(
        settings,
        dist,
        steps_per_epoch=per_epoch,
        total_steps=settings.steps,
        start_step=start,
        precision="fp32",
        device="cpu",
        decoder=None,
        fingerprint=PRINT,
        save_state=lambda step: f"{step}".encode(),
        evaluate=evaluate,
    )
    for step in run.steps():
        run.step_done(step, lambda: 0.5)
    report = run.finish()
    finish_writes()  # as the job does, once its backend is down
    return report, CheckpointDir(settings.checkpoint_dir, settings.keep_checkpoints).steps()


def test_loop_checkpoints_every_n_steps_and_at_the_end(tmp_path: Path) -> None:
    flags = ["--steps", "14", "--checkpoint-every", "3", "--keep-checkpoints", "10"]
    report, saved = run_steps(tmp_path, [*flags, "--metrics-json", str(tmp_path / "m.json")], per_epoch=7)
    assert saved == [3, 6, 9, 12, 14]
    assert report == json.loads((tmp_path / "m.json").read_text())
    assert (report["steps"], report["final_loss"], report["resumed_from_step"]) == (14, 0.5, None)
    assert report["warmup_steps_excluded"] == 10 and report["images_per_sec"] > 0


def test_loop_default_checkpoints_once_per_epoch_and_resumes(tmp_path: Path) -> None:
    calls: list[int] = []

    def evaluate() -> tuple[int, int]:
        calls.append(1)
        return 3, 4

    _, saved = run_steps(tmp_path, ["--steps", "8"], evaluate)
    assert saved == [4, 8] and len(calls) == 2
    report, saved = run_steps(tmp_path, ["--steps", "12"], evaluate)
    assert saved == [4, 8, 12] and report["resumed_from_step"] == 8
    assert report["val_top1"] == 0.75 and report["epochs"] == 3
    with pytest.raises(CheckpointRefused, match="is at step 12, past this run's 4 steps") as refused:
        run_steps(tmp_path, ["--steps", "4"])
    assert refused.value.every_rank  # the verdict is broadcast: rank 0 alone reports it


def test_a_checkpoint_or_metrics_write_that_fails_later_names_the_path(tmp_path: Path) -> None:
    # Both outputs passed the up-front check; then their directories turned into files.
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(
        OutputPathError, match=f"cannot write --checkpoint-dir {blocker / 'ckpt'}: a part of the path is a file"
    ):
        run_steps(tmp_path, ["--steps", "2"], checkpoint_dir=blocker / "ckpt")
    with pytest.raises(
        OutputPathError, match=f"cannot write --metrics-json {blocker / 'm.json'}: a part of the path is a file"
    ):
        run_steps(tmp_path, ["--steps", "2", "--metrics-json", str(blocker / "m.json")])


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_decode_gives_rgb_crops_of_the_requested_size(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "image.JPEG"
    Image.new(mode, (500, 375), "white" if mode != "CMYK" else (0, 0, 0, 0)).save(path)
    train = data.decode_train(str(path), 64, np.random.default_rng(0))
    val = data.decode_val(str(path), 64)
    for image in (train, val):
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8
        assert image.min() > 240  # white stays white through draft, crop and resize


def test_an_eviction_signal_stops_the_loop_at_the_next_agreed_boundary_with_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vote is read one boundary after it was cast: signalled during step 3, every rank learns it
    at the end of step 4, saves there (between the periodic checkpoints) and stops."""
    monkeypatch.setattr(preemption, "_signalled", [])
    settings = parse_settings(
        "pytorch", ["--checkpoint-dir", str(tmp_path), "--steps", "10", "--checkpoint-every", "100"]
    )
    run = TrainingRun(
        settings, OneProcess(), steps_per_epoch=10, total_steps=10, start_step=0, precision="fp32",
        device="cpu", decoder=None, fingerprint=PRINT, save_state=lambda step: f"{step}".encode(),
    )  # fmt: skip
    with pytest.raises(Preempted, match=r"after step 4: saved the checkpoint of step 4") as stopped:
        for step in run.steps():
            if step == 2:
                preemption._record(signal.SIGUSR1, None)
            run.step_done(step, lambda: 0.5)
    assert stopped.value.exit_code == 75 and stopped.value.every_rank
    assert CheckpointDir(tmp_path, settings.keep_checkpoints).steps() == [4]
