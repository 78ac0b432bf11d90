"""The jobs are command-line tools: bad input is one ``error:`` line and exit 2, with no traceback
and before any training; a broken input pipeline ends the job within seconds; and a job leaves
with its status even when threads outlive its backend."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.training.jobs import (
    REPO,
    TINY,
    error_lines,
    horovodrun,
    make_imagenet,
    read_metrics,
    run,
    single,
    torchrun,
    truncate_images,
)
from training.checkpoint.files import Fingerprint, checkpoint_path, write_checkpoint
from training.run.outputs import MIN_FREE_ENV
from training.world.launcher_exit import horovod_first_failure, report, run_torchrun

Case = tuple[list[object], str, dict[str, str]]  # job flags, the error message expected, extra environment


def negative_steps(tmp_path: Path) -> Case:
    return ["--steps", "-1"], "argument --steps: must be a positive integer, got -1", {}


def zero_batch_size(tmp_path: Path) -> Case:
    return ["--batch-size", "0"], "argument --batch-size: must be a positive integer up to 65536, got 0", {}


def missing_data_dir(tmp_path: Path) -> Case:
    missing = tmp_path / "no-such-imagenet"
    return ["--data", "imagenet", "--data-dir", missing], f"data directory {missing} does not exist", {}


def empty_class_folder(tmp_path: Path) -> Case:
    root = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=4, val_per_class=1, corrupt=0)
    for image in (root / "val" / "n00000001").iterdir():
        image.unlink()
    return (
        ["--data", "imagenet", "--data-dir", root],
        f"class folder {root / 'val' / 'n00000001'} contains no images",
        {},
    )


def unwritable_checkpoint_dir(tmp_path: Path) -> Case:
    # Root ignores permission bits, so "unwritable" is a path through a file: it fails for everyone.
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "ckpt"
    return ["--checkpoint-dir", target], f"cannot write --checkpoint-dir {target}: a part of the path is a file", {}


def unwritable_metrics_json(tmp_path: Path) -> Case:
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "metrics.json"
    return ["--metrics-json", target], f"cannot write --metrics-json {target}: a part of the path is a file", {}


def full_disk(tmp_path: Path) -> Case:
    # The free-space floor is raised past any disk's size: the same refusal a full disk gets.
    flags: list[object] = ["--checkpoint-dir", tmp_path / "ckpt"]
    return flags, f"--checkpoint-dir {tmp_path / 'ckpt'}: only", {MIN_FREE_ENV: str(2**40)}


def corrupt_only_checkpoint(tmp_path: Path) -> Case:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    checkpoint_path(ckpt, 10).write_bytes(b"\0" * 100)
    return ["--checkpoint-dir", ckpt], f"no usable checkpoint in {ckpt} (ckpt-0000000010.ckpt: not a checkpoint", {}


def checkpoint_of_another_model(tmp_path: Path) -> Case:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, 10, Fingerprint.of("pytorch", "resnet50", 1000, []), b"state")
    expected = f"checkpoint {checkpoint_path(ckpt, 10)} holds pytorch resnet50 with 1000 classes"
    return ["--checkpoint-dir", ckpt], expected, {}


def abbreviated_flag(tmp_path: Path) -> Case:
    # argparse would otherwise take --lr-decay for --lr-decay-epochs, and -1 for an epoch list
    return ["--lr-decay", "-1"], "unrecognized arguments: --lr-decay -1", {}


def huge_batch_size(tmp_path: Path) -> Case:
    return ["--batch-size", 10**20], "argument --batch-size: must be a positive integer up to 65536", {}


def data_dir_is_a_file(tmp_path: Path) -> Case:
    (tmp_path / "file").write_text("x")
    return ["--data", "imagenet", "--data-dir", tmp_path / "file"], f"data directory {tmp_path / 'file'} is a file", {}


def one_class_data_dir(tmp_path: Path) -> Case:
    root = make_imagenet(tmp_path / "imagenet", classes=1, train_per_class=8, val_per_class=1, corrupt=0)
    message = f"{root / 'train'} has one class (n00000000): a classifier needs at least two class folders"
    return ["--data", "imagenet", "--data-dir", root], message, {}


def epochs_and_steps(tmp_path: Path) -> Case:
    # --steps is the whole run's length: with --epochs too, one of them would be ignored
    return ["--epochs", "3"], "argument --epochs: not allowed with argument --steps", {}


def ddp_outside_torchrun(tmp_path: Path) -> Case:
    return ["--backend", "ddp"], "--backend ddp runs under torchrun: torchrun --nproc-per-node N", {}


def mesh_layout(tmp_path: Path) -> Case:
    # one parser for both PyTorch trainers: the data-parallel one refuses a layout only the other trains
    return ["--tp", "2"], "--tp 2: a mesh layout (--tp, --pp, --dp-shard) runs under torchrun", {}


@pytest.mark.parametrize(
    "case",
    [
        negative_steps,
        zero_batch_size,
        missing_data_dir,
        empty_class_folder,
        unwritable_checkpoint_dir,
        unwritable_metrics_json,
        full_disk,
        corrupt_only_checkpoint,
        checkpoint_of_another_model,
        ddp_outside_torchrun,
        mesh_layout,
        abbreviated_flag,
        huge_batch_size,
        data_dir_is_a_file,
        one_class_data_dir,
        epochs_and_steps,
    ],
)
def test_bad_input_is_one_error_line_and_exit_2_before_training(tmp_path: Path, case: Callable[[Path], Case]) -> None:
    flags, message, env = case(tmp_path)
    output = run(single("pytorch", *TINY, "--steps", 2, *flags), tmp_path / "job.log", expect_rc=2, env=env)
    [line] = error_lines(output)
    assert line.startswith(f"error: {message}"), output
    assert "Traceback" not in output
    assert "starting at step" not in output  # refused before the first step


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow", "keras"])
def test_steps_is_the_whole_runs_length_across_epochs(tmp_path: Path, framework: str) -> None:
    """16 images in batches of 4 are 4 steps per epoch: --steps 10 trains 10 steps, in 3 epochs."""
    root = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=8, val_per_class=1, corrupt=0)
    metrics = tmp_path / "metrics.json"
    flags = ["--data", "imagenet", "--data-dir", root, "--steps", 10, "--metrics-json", metrics]
    run(single(framework, *TINY, *flags), tmp_path / "job.log")
    report = read_metrics(metrics)
    assert (report["steps"], report["epochs"]) == (10, 3)


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun"])
def test_the_wrapped_launchers_exit_2_on_bad_input_with_one_line_and_no_traceback(
    tmp_path: Path, launcher: str
) -> None:
    """The plain launchers raise after a worker fails: a 25-line traceback, exit 1. Wrapped, the
    worker's own status and line: a layout the world cannot take (a model-parallel torchrun as
    docs/training.md runs one, with 3 pipeline stages on 2 processes), a flag every rank refuses
    (horovodrun)."""
    if launcher == "torchrun":
        job = ["-m", "training.model_parallel", "--model", "gpt-tiny", "--pp", 3, "--seq-len", 64, "--steps", 2]
        cmd = [sys.executable, "-m", "training.torchrun", "--standalone", "--nproc-per-node", 2, *job]
        message = "--tp 1 x --pp 3 = 3 does not divide the world size 2"
    else:
        # a flag every rank refuses as it parses: rank 0 alone says so
        job = [sys.executable, "-m", "training.pytorch", *TINY, "--steps", 0]
        cmd = [sys.executable, "-m", "training.horovodrun", "-np", 2, "-H", "localhost:2", "--gloo", *job]
        message = "argument --steps: must be a positive integer, got 0"
    output = run(cmd, tmp_path / "job.log", expect_rc=2)
    [line] = error_lines(output)
    assert line.endswith(f"error: {message}") or message in line, output
    assert "Traceback" not in output and "ChildFailedError" not in output and "RuntimeError" not in output


def test_a_refusal_every_rank_meets_is_reported_once_by_rank_0(tmp_path: Path) -> None:
    flags, message, _ = corrupt_only_checkpoint(tmp_path)
    output = run(horovodrun(2, "pytorch", *TINY, "--steps", 2, *flags), tmp_path / "job.log", expect_rc=1)
    [line] = error_lines(output)
    assert line.startswith(f"[0]<stderr>:error: {message}")
    assert "Process name: 0\nExit code: 2" in output  # rank 0 exits first, so horovodrun names it


def test_a_checkpoint_of_another_framework_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, 10, Fingerprint.of("pytorch", "resnet_tiny", 1000, []), b"state")
    output = run(single("keras", *TINY, "--checkpoint-dir", ckpt), tmp_path / "job.log", expect_rc=2)
    [line] = error_lines(output)
    assert "holds pytorch resnet_tiny with 1000 classes" in line
    assert "but this run is tensorflow resnet_tiny with 1000 classes" in line  # Keras writes TensorFlow's
    assert "use another --checkpoint-dir, or delete" in line
    assert "Traceback" not in output


def test_debug_shows_the_traceback_and_keeps_the_status(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    output = run(
        single("pytorch", *TINY, "--data", "imagenet", "--data-dir", missing, "--debug"),
        tmp_path / "job.log",
        expect_rc=2,
    )
    assert "Traceback" in output and f"error: data directory {missing} does not exist" in output


def test_ignore_bad_checkpoints_starts_fresh_with_a_warning(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    checkpoint_path(ckpt, 10).write_bytes(b"\0" * 100)
    output = run(
        single("pytorch", *TINY, "--steps", 2, "--checkpoint-dir", ckpt, "--ignore-bad-checkpoints"),
        tmp_path / "job.log",
    )
    assert f"no usable checkpoint in {ckpt}" in output and "starting from step 0" in output
    assert "falling back" not in output  # there was nothing to fall back to
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-0000000002.ckpt", "ckpt-0000000010.ckpt.corrupt"]


# --- a broken input pipeline ends the job in seconds ------------------------------------------------


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow", "keras"])
def test_an_unreadable_data_directory_ends_the_job_in_seconds(tmp_path: Path, framework: str) -> None:
    # Every JPEG truncated: the decode fails inside DataLoader workers or tf.data's threads, and
    # used to come back as TensorFlow's UnknownError, then hang in the iterator's destructor.
    root = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=8, val_per_class=2, corrupt=0)
    truncate_images(root)
    # what this catches is the hang; the bound leaves room for TensorFlow's import on a loaded host
    # (a few seconds in all on an idle one)
    output = run(single(framework, *TINY, "--data", "imagenet", "--data-dir", root), tmp_path / "job.log", 120, 2)
    [line] = error_lines(output)
    assert line.startswith(f"error: 16 images in a row under {root / 'train'} could not be decoded")
    assert "Traceback" not in output and "UnknownError" not in output


TWO_PROCESS_LAUNCHES = {
    "horovodrun-pytorch": lambda data: horovodrun(2, "pytorch", *TINY, *data),
    "horovodrun-tensorflow": lambda data: horovodrun(2, "tensorflow", *TINY, *data),
    "torchrun-ddp": lambda data: torchrun(2, *TINY, *data, "--backend", "ddp"),
}


@pytest.mark.parametrize("launch", sorted(TWO_PROCESS_LAUNCHES))
def test_an_unreadable_data_directory_ends_a_two_process_job(tmp_path: Path, launch: str) -> None:
    """Both ranks meet the broken files: rank 0 reports them, its exit (bad input) stops the other, and
    nothing either started (decode workers, the forkserver) outlives the launcher, which used to wait
    for ever on the output pipe they held."""
    root = make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=8, val_per_class=2, corrupt=0)
    truncate_images(root)
    cmd = TWO_PROCESS_LAUNCHES[launch](["--data", "imagenet", "--data-dir", root])
    output = run(cmd, tmp_path / "job.log", timeout=60, expect_rc=1)  # the launcher's own status for any failure
    assert re.search(r"^(Exit code|\s*exitcode)\s*: 2\b", output, re.M), output[-3000:]  # the first failure: bad input
    [line] = error_lines(output)
    assert "16 images in a row" in line


def test_a_model_parallel_job_on_truncated_text_ends_with_one_error(tmp_path: Path) -> None:
    root = tmp_path / "text"
    root.mkdir()
    for i in range(2):
        (root / f"part-{i}.txt").write_bytes(b"cut")  # truncated: fewer bytes than one sequence
    job = ["--model", "gpt-tiny", "--dp-shard", "-1", "--seq-len", "32", "--batch-size", "2", "--steps", "2"]
    cmd = torchrun(2, *job, "--data", "text", "--data-dir", root, module="training.model_parallel")
    output = run(cmd, tmp_path / "job.log", timeout=60, expect_rc=1)
    assert re.search(r"^\s*exitcode\s*: 2\b", output, re.M), output[-3000:]
    [line] = error_lines(output)
    assert f"--data-dir {root}: 2 files with 6 bytes in all, fewer than one sequence" in line


# --- leaving: nothing that runs after the backend shut down can change the status ------------------

# A backend whose thread outlives everything, as gloo's threads outlive destroy_process_group():
# a process that let Python finalize would wait for it forever.
STUCK_THREAD_JOB = """
import logging, sys, threading
from training.data.imagenet import DataDirError
from training.run.job import run_job

class Backend:
    backend, rank, size, local_rank, local_size, failures = "test", 0, 1, 0, 1, ()
    def __init__(self, args):
        threading.Thread(target=threading.Event().wait).start()  # not a daemon, never ends
    def allgather_object(self, obj):
        return [obj]
    def shutdown(self):
        pass

def train(args, backend):
    logging.getLogger("job").info("trained")
    outcome = sys.argv[1]
    if outcome == "bad-input":
        raise DataDirError("data directory /x does not exist")
    if outcome == "bug":
        raise ZeroDivisionError("division by zero")

run_job("pytorch", [], Backend, train)
"""


@pytest.mark.parametrize(
    ("outcome", "status", "message"),
    [
        ("success", 0, None),
        ("bad-input", 2, "error: data directory /x does not exist"),
        ("bug", 1, "error: ZeroDivisionError: division by zero"),
    ],
)
def test_a_job_exits_with_its_status_though_a_thread_outlives_its_backend(
    tmp_path: Path, outcome: str, status: int, message: str | None
) -> None:
    output = run([sys.executable, "-c", STUCK_THREAD_JOB, outcome], tmp_path / "job.log", timeout=30, expect_rc=status)
    assert "trained" in output  # the log was flushed before the process left
    assert error_lines(output) == ([message] if message else [])
    assert ("Traceback" in output) == (outcome == "bug")  # only a bug gets its traceback


def test_a_worker_ended_by_a_signal_is_named_and_exits_as_a_shell_would(capsys: pytest.CaptureFixture[str]) -> None:
    # horovod 0.28.1's message for the first failed process
    message = "Horovod detected that one or more processes exited with non-zero status, thus causing the job "
    message += "to be terminated. The first process to do so was:\nProcess name: 1\nExit code: -9\n"
    assert horovod_first_failure(RuntimeError(message)) == ("process 1", -9)
    assert horovod_first_failure(RuntimeError("something else")) is None
    assert report("process 1", -9) == 137
    assert capsys.readouterr().err == "error: process 1 was killed by SIGKILL\n"
    assert report("rank 0", 2) == 2 and capsys.readouterr().err == ""


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # pytest's captured stderr has no fileno
def test_a_launcher_refusing_its_own_arguments_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = sys.argv
    try:
        assert run_torchrun(["--nproc-per-node", "x", "-m", "training.pytorch"]) == 2
    finally:
        sys.argv = argv
    assert capsys.readouterr().err == "error: torchrun: Unsupported nproc_per_node value: x\n"


def test_a_worker_command_that_does_not_exist_is_one_line_and_a_shells_127(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.torchrun",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--no-python",
            "nosuchprog",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 127
    assert proc.stderr.strip() == "error: torchrun: cannot run nosuchprog: No such file or directory", proc.stderr
