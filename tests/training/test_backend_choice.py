"""The data-parallel jobs run their launcher's backend: ``--backend auto`` follows it, Horovod under
torchrun is refused (each process would train alone), and Horovod missing is one line, exit 3."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.training.jobs import TINY, error_lines, read_metrics, run, run_in_this_process, torchrun
from training import pytorch
from training.config.args import parse_args
from training.config.settings import parse_settings
from training.errors import ExitCode
from training.world.backend_choice import BackendRefused, choose_backend

TORCHRUN_2 = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
HOROVODRUN_2 = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}


@pytest.mark.parametrize(
    ("env", "backend"),
    [
        ({}, "horovod"),  # a plain python: Horovod runs a world of one
        (HOROVODRUN_2, "horovod"),
        ({**HOROVODRUN_2, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node-0"}, "horovod"),  # inherited
        (TORCHRUN_2, "ddp"),
        ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "node-0"}, "ddp"),  # another launcher of torch's
    ],
)
def test_auto_follows_the_launcher(env: dict[str, str], backend: str) -> None:
    assert choose_backend("pytorch", "auto", env) == backend
    assert parse_args("pytorch", [], env).backend == backend


def test_horovod_under_torchrun_is_refused_unless_the_world_is_one() -> None:
    with pytest.raises(BackendRefused, match=r"Horovod does not see torchrun's 2 processes, so each would train alone"):
        choose_backend("pytorch", "horovod", TORCHRUN_2)
    assert choose_backend("pytorch", "horovod", {**TORCHRUN_2, "WORLD_SIZE": "1"}) == "horovod"
    assert choose_backend("pytorch", "ddp", TORCHRUN_2) == "ddp"


@pytest.mark.parametrize("framework", ["tensorflow", "keras"])
def test_tensorflow_and_keras_refuse_torchrun(framework: str) -> None:
    with pytest.raises(
        BackendRefused, match=rf"training.{framework} with Horovod under torchrun: .*start it with horovodrun"
    ):
        choose_backend(framework, None, TORCHRUN_2)
    assert choose_backend(framework, None, HOROVODRUN_2) == "horovod"


def test_local_sgd_needs_no_backend_flag_under_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args("pytorch", ["--sync", "local-sgd"], TORCHRUN_2).sync == "local-sgd"
    with pytest.raises(SystemExit) as exited:  # outside torchrun auto is Horovod, which has no averager
        parse_args("pytorch", ["--sync", "local-sgd"], {})
    assert exited.value.code == ExitCode.BAD_INPUT
    assert "error: --sync local-sgd needs --backend ddp (torchrun)" in capsys.readouterr().err


def test_torchrun_without_a_backend_flag_trains_one_ddp_job(tmp_path: Path) -> None:
    """Before --backend auto this trained two separate Horovod jobs of world size 1."""
    metrics = tmp_path / "metrics.json"
    run(torchrun(2, *TINY, "--steps", 2, "--metrics-json", metrics), tmp_path / "job.log")
    report = read_metrics(metrics)
    assert (report["backend"], report["world_size"], report["global_batch_size"]) == (
        "ddp",
        2,
        2 * report["batch_size_per_worker"],
    )


def test_horovod_named_under_torchrun_is_one_line_and_exit_2(tmp_path: Path) -> None:
    job = ["-m", "training.pytorch", *TINY, "--steps", 2, "--backend", "horovod"]
    cmd = [sys.executable, "-m", "training.torchrun", "--standalone", "--nproc-per-node", 2, *job]
    output = run(cmd, tmp_path / "job.log", expect_rc=2)
    [line] = error_lines(output)
    assert "with Horovod under torchrun: Horovod does not see torchrun's 2 processes" in line, output
    assert "Traceback" not in output and "starting at step" not in output


def test_horovod_missing_is_one_line_and_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "horovod", None)  # as on a machine without Horovod: the import fails
    settings = parse_settings("pytorch", [*map(str, TINY), "--steps", "1", "--backend", "horovod"])
    status = run_in_this_process(monkeypatch, settings, pytorch.start_backend, pytorch.train)
    err = capsys.readouterr().err
    assert status == ExitCode.NOT_READY and "Traceback" not in err
    [line] = error_lines(err)
    assert line.startswith(
        "error: the horovod backend needs Horovod, which does not import here (ModuleNotFoundError: "
    )
    assert "): start the job with torchrun (--backend auto then runs ddp), or install Horovod" in line
