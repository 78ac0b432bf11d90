"""Training curves: TensorBoard event files that TensorBoard's own reader parses, and summary.png,
from the recorder alone, from the step loop, and from real 2-process PyTorch and TensorFlow jobs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from tests.training.jobs import TINY, error_lines, horovodrun, make_imagenet, read_metrics, run, single
from tests.training.test_training_units import OneProcess
from training.checkpoint.files import Fingerprint
from training.config.settings import TrainingSettings, parse_settings
from training.errors import BadInput, OutputPathError
from training.run import curves, outputs
from training.run.curves import FINAL_IMAGES_PER_SEC, IMAGES_PER_SEC, LOSS, LR, PNG_SIZE, VAL_TOP1, Curves
from training.run.loop import TrainingRun

Scalars = dict[str, list[tuple[int, float]]]
LOSS_COLOUR, RATE_COLOUR = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 and C1


def read_scalars(directory: Path) -> Scalars:
    """Every scalar series of the event files in ``directory``, as TensorBoard loads them."""
    accumulator = EventAccumulator(str(directory), size_guidance={SCALARS: 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def colour_pixels(image: Image.Image, colour: tuple[int, int, int]) -> int:
    """Pixels within a small distance of ``colour`` (line centres and markers are drawn in it)."""
    return sum(
        count
        for count, pixel in image.getcolors(image.width * image.height)
        if all(abs(a - b) <= 24 for a, b in zip(pixel[:3], colour, strict=True))
    )


def check_summary_png(path: Path) -> None:
    """The expected size, the loss curve in the left panel and the images/s curve in the right one."""
    with Image.open(path) as png:
        assert png.format == "PNG" and png.size == PNG_SIZE
        image = png.convert("RGB")
    width, height = image.size
    left, right = image.crop((0, 0, width // 2, height)), image.crop((width // 2, 0, width, height))
    assert len(image.getcolors(width * height)) > 50  # text, axes, antialiased curves: not a blank page
    assert colour_pixels(left, LOSS_COLOUR) > 15 and colour_pixels(right, LOSS_COLOUR) == 0
    assert colour_pixels(right, RATE_COLOUR) > 15 and colour_pixels(left, RATE_COLOUR) == 0


# --- the recorder ---------------------------------------------------------------------------------


def test_recorded_scalars_read_back_with_tensorboard(tmp_path: Path) -> None:
    recorder = Curves(tmp_path / "tb", start_step=0)
    recorder.add(5, {LOSS: 2.5, LR: 0.1, IMAGES_PER_SEC: None})  # the first log step has no rate yet
    recorder.add(10, {LOSS: 1.25, LR: 0.2, IMAGES_PER_SEC: 300.0})
    recorder.add(10, {VAL_TOP1: 0.75})
    # Flushed at every add: readable before close, as a killed run leaves it.
    assert read_scalars(tmp_path / "tb")[LOSS] == [(5, 2.5), (10, 1.25)]
    recorder.add(12, {FINAL_IMAGES_PER_SEC: 250.0})
    recorder.close()
    expected = {
        LOSS: [(5, 2.5), (10, 1.25)],
        LR: [(5, pytest.approx(0.1)), (10, pytest.approx(0.2))],  # stored as float32
        IMAGES_PER_SEC: [(10, 300.0)],
        VAL_TOP1: [(10, 0.75)],
        FINAL_IMAGES_PER_SEC: [(12, 250.0)],
    }
    assert read_scalars(tmp_path / "tb") == expected
    assert recorder.series == expected
    assert len(event_files(tmp_path / "tb")) == 1


def test_a_resumed_run_continues_the_curves_and_replaces_what_followed_its_checkpoint(tmp_path: Path) -> None:
    first = Curves(tmp_path, start_step=0)
    for step in (5, 10, 15):  # killed after step 15, its last checkpoint at step 10
        first.add(step, {LOSS: float(step)})
    first.close()
    second = Curves(tmp_path, start_step=10)
    second.add(15, {LOSS: 1.5})
    second.add(20, {LOSS: 2.0})
    second.close()
    assert len(event_files(tmp_path)) == 2
    assert read_scalars(tmp_path)[LOSS] == [(5, 5.0), (10, 10.0), (15, 1.5), (20, 2.0)]


def test_summary_png_shows_both_curves_even_with_one_point(tmp_path: Path) -> None:
    series = {LOSS: [(10, 2.3)], IMAGES_PER_SEC: [(10, 120.0)]}
    curves.write_summary_png(tmp_path / "one.png", series, "pytorch (horovod) resnet_tiny: 2 workers x batch 4")
    check_summary_png(tmp_path / "one.png")
    many = {LOSS: [(s, 3.0 / s) for s in range(1, 50)], IMAGES_PER_SEC: [(s, 100.0 + s) for s in range(2, 50)]}
    curves.write_summary_png(tmp_path / "many.png", {**many, FINAL_IMAGES_PER_SEC: [(49, 140.0)]}, "title")
    check_summary_png(tmp_path / "many.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.png", "one.png"]  # no temporary file left


def test_summary_png_check_fails_on_a_missing_curve(tmp_path: Path) -> None:
    curves.write_summary_png(tmp_path / "s.png", {LOSS: [(1, 2.0), (2, 1.0)]}, "no images/s")
    with pytest.raises(AssertionError):
        check_summary_png(tmp_path / "s.png")


# --- the step loop (one process) ------------------------------------------------------------------


class RankZeroOfTwo(OneProcess):
    """Rank 0 of two, whose peer's loss is always 1 higher (the other values it gathers are the same)."""

    size = 2

    def allgather_object(self, obj: Any) -> list[Any]:
        if isinstance(obj, float):
            return [obj, obj + 1]
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[2], str):  # a log step: (loss, compute, host)
            return [obj, (obj[0] + 1, obj[1], "peer")]
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[1], float):  # finish(): the last loss
            return [obj, (obj[0], obj[1] + 1, obj[2])]
        return [obj, obj]


def training_run(
    settings: TrainingSettings,
    evaluate: Callable[[], tuple[int, int]] | None = None,
    per_epoch: int = 4,
    dist: OneProcess | None = None,
) -> TrainingRun:
    return TrainingRun(
        settings,
        dist or OneProcess(),
        steps_per_epoch=per_epoch,
        total_steps=settings.steps,
        start_step=0,
        precision="fp32",
        device="cpu",
        decoder=None,
        fingerprint=Fingerprint.of("pytorch", "resnet_tiny", 2, []),
        save_state=lambda step: b"",
        evaluate=evaluate,
    )


def test_the_loop_records_every_tag_at_global_steps(tmp_path: Path) -> None:
    flags = ["--steps", "8", "--log-every", "3", "--timing-warmup-steps", "1"]
    outputs_flags = ["--tensorboard-dir", str(tmp_path / "tb"), "--summary-png", str(tmp_path / "summary.png")]
    run = training_run(parse_settings("pytorch", [*flags, *outputs_flags]), evaluate=lambda: (3, 4))
    for step in run.steps():
        run.step_done(step, lambda step=step: 4.0 - step * 0.25)
    metrics = run.finish()
    scalars = read_scalars(tmp_path / "tb")
    assert sorted(scalars) == sorted([LOSS, LR, IMAGES_PER_SEC, VAL_TOP1, FINAL_IMAGES_PER_SEC])
    assert scalars[LOSS] == [(3, 3.5), (6, 2.75), (8, 2.25)]  # log steps, then the unlogged last step
    assert [step for step, _ in scalars[LR]] == [3, 6]
    assert scalars[LR][1][1] == pytest.approx(run.lr(5))
    assert [step for step, _ in scalars[IMAGES_PER_SEC]] == [3, 6]  # from the first log step after warmup
    assert scalars[VAL_TOP1] == [(4, 0.75), (8, 0.75)]  # every epoch's end
    assert scalars[FINAL_IMAGES_PER_SEC] == [(8, pytest.approx(metrics["images_per_sec"]))]
    check_summary_png(tmp_path / "summary.png")


@pytest.mark.parametrize(("steps", "expected"), [(20, list(range(1, 21))), (100, list(range(5, 101, 5))), (1000, None)])
def test_without_log_every_a_short_run_still_draws_a_curve(tmp_path: Path, steps: int, expected: list | None) -> None:
    """The README's 20-step example: every step is a point of its loss curve, not steps 10 and 20; a long
    run logs every 10 steps as before."""
    settings = parse_settings("pytorch", ["--steps", str(steps), "--tensorboard-dir", str(tmp_path / "tb")])
    run = training_run(settings)
    for step in run.steps():
        run.step_done(step, lambda step=step: 4.0 - step * 0.001)
    run.finish()
    logged = [step for step, _ in read_scalars(tmp_path / "tb")[LOSS]]
    assert logged == (expected or list(range(10, steps + 1, 10)))


def test_the_loss_curve_is_the_mean_over_ranks_as_in_metrics_json(tmp_path: Path) -> None:
    flags = ["--steps", "5", "--log-every", "2", "--tensorboard-dir", str(tmp_path / "tb")]
    run = training_run(parse_settings("pytorch", flags), dist=RankZeroOfTwo())
    for step in run.steps():
        run.step_done(step, lambda step=step: 4.0 - step)
    metrics = run.finish()
    assert read_scalars(tmp_path / "tb")[LOSS] == [(2, 3.5), (4, 1.5), (5, 0.5)]  # rank 0's + 0.5
    assert metrics["final_loss"] == 0.5


def test_a_curve_write_that_fails_later_names_the_path(tmp_path: Path) -> None:
    # The outputs passed the up-front check; then their directories turned into files.
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(
        OutputPathError, match=f"cannot write --tensorboard-dir {blocker / 'tb'}: a part of the path is a file"
    ):
        training_run(parse_settings("pytorch", ["--steps", "2", "--tensorboard-dir", str(blocker / "tb")]))
    run = training_run(parse_settings("pytorch", ["--steps", "2", "--summary-png", str(blocker / "s.png")]))
    for step in run.steps():
        run.step_done(step, lambda: 1.0)
    with pytest.raises(OutputPathError, match=f"cannot write --summary-png {blocker / 's.png'}: a part of the path"):
        run.finish()


def test_a_missing_plotting_package_is_refused_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--summary-png", str(tmp_path / "s.png"), "--tensorboard-dir", str(tmp_path / "tb")]
    settings = parse_settings("keras", flags)
    outputs.check_output_paths(settings, {outputs.MIN_FREE_ENV: "1"})
    monkeypatch.setattr(outputs, "find_spec", lambda name: None if name == "matplotlib" else object())
    with pytest.raises(BadInput, match=r"^--summary-png needs the Python package matplotlib, which this environment"):
        outputs.check_output_paths(settings, {outputs.MIN_FREE_ENV: "1"})


# --- real jobs ------------------------------------------------------------------------------------


def curve_flags(tmp_path: Path) -> list[Any]:
    return ["--tensorboard-dir", tmp_path / "tb", "--summary-png", tmp_path / "summary.png"]


def test_a_two_process_pytorch_job_writes_curves_and_summary_png(tmp_path: Path) -> None:
    # 2 classes x 8 train images = one 2-step epoch per rank; 3 validated epochs, logged every 2 steps.
    data = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=8, val_per_class=2, corrupt=0)
    # the first step is timing warmup: the window rates, like the run's, leave it out
    options = ["--data", "imagenet", "--data-dir", data, "--epochs", 3, "--log-every", 2, "--timing-warmup-steps", 1]
    metrics_path = tmp_path / "metrics.json"
    cmd = horovodrun(2, "pytorch", *TINY, *options, *curve_flags(tmp_path), "--metrics-json", metrics_path)
    run(cmd, tmp_path / "job.log", timeout=120)
    [events] = event_files(tmp_path / "tb")  # rank 0 alone writes
    scalars = read_scalars(events.parent)
    assert {LOSS, LR, IMAGES_PER_SEC, VAL_TOP1} <= scalars.keys()
    assert [step for step, _ in scalars[LOSS]] == [2, 4, 6]
    assert [step for step, _ in scalars[IMAGES_PER_SEC]] == [2, 4, 6]
    assert [step for step, _ in scalars[VAL_TOP1]] == [2, 4, 6]
    metrics = read_metrics(metrics_path)
    assert scalars[VAL_TOP1][-1][1] == pytest.approx(metrics["val_top1"])
    assert scalars[FINAL_IMAGES_PER_SEC] == [(6, pytest.approx(metrics["images_per_sec"]))]
    check_summary_png(tmp_path / "summary.png")


def test_a_two_process_tensorflow_job_writes_curves(tmp_path: Path) -> None:
    options = ["--steps", 6, "--log-every", 3, "--timing-warmup-steps", 1]
    cmd = horovodrun(2, "tensorflow", *TINY, *options, *curve_flags(tmp_path))
    run(cmd, tmp_path / "job.log", timeout=120)
    [events] = event_files(tmp_path / "tb")
    scalars = read_scalars(events.parent)
    assert sorted(scalars) == sorted([LOSS, LR, IMAGES_PER_SEC, FINAL_IMAGES_PER_SEC])  # synthetic: no val/
    assert [step for step, _ in scalars[LOSS]] == [3, 6]
    assert [step for step, _ in scalars[IMAGES_PER_SEC]] == [3, 6]  # two points: a curve, not a dot
    check_summary_png(tmp_path / "summary.png")


def summary_png_is_a_directory(tmp_path: Path) -> tuple[list[Any], str]:
    return ["--summary-png", tmp_path], f"--summary-png {tmp_path} is a directory: pass the path of a file"


def unwritable_tensorboard_dir(tmp_path: Path) -> tuple[list[Any], str]:
    (tmp_path / "file").write_text("x")  # root ignores permission bits: a path through a file fails for everyone
    target = tmp_path / "file" / "tb"
    reason = "a part of the path is a file, not a directory (choose another --tensorboard-dir or fix its permissions)"
    return ["--tensorboard-dir", target], f"cannot write --tensorboard-dir {target}: {reason}"


@pytest.mark.parametrize("case", [summary_png_is_a_directory, unwritable_tensorboard_dir])
def test_bad_curve_outputs_exit_2_before_training(
    tmp_path: Path, case: Callable[[Path], tuple[list[Any], str]]
) -> None:
    flags, message = case(tmp_path)
    output = run(single("pytorch", *TINY, "--steps", 2, *flags), tmp_path / "job.log", expect_rc=2)
    assert error_lines(output) == [f"error: {message}"]
    assert "Traceback" not in output
    assert "starting at step" not in output  # refused before the first step
