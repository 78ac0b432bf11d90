"""The checkpoint job tools, run as the cluster runs them (`python3 FILE`, outside any package), against a
real Azurite: checkpoint_mirror.py uploads complete files only, fetch_checkpoint.py brings a run's newest
checkpoint back with a read-only SAS, time_warning.py passes SIGUSR1 on to a process that catches it
late; and `launch --warn-before`'s rules."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from azure.storage.blob import ContainerSasPermissions
from pydantic import SecretStr

from dtrain.cluster.description import BlobCredential, BlobLocation, from_stack_outputs
from dtrain.errors import OperatorError
from dtrain.jobs.checkpoint_sync import OUR_CHECKPOINT
from dtrain.jobs.kept_checkpoints import require_kept_checkpoint
from dtrain.jobs.time_warning import parse_lead, warning_lead
from dtrain.remote.boot.spot_agent import signal_ranks
from tests.polling import wait_for

from .conftest import private_key_file
from .test_cluster_description import OUTPUTS
from .test_remote_tools import REMOTE, azurite, container_sas, run_tool, sas_file  # noqa: F401 (a fixture)

READ_ONLY = ContainerSasPermissions(read=True, list=True)
WRITE_ONLY = ContainerSasPermissions(create=True, write=True)


def blob_names(service, prefix: str) -> set[str]:
    return {b.name for b in service.get_container_client("results").list_blobs(name_starts_with=prefix)}


def _mirror_in_process(azurite, tmp_path, monkeypatch, directory, prefix, clock):  # noqa: F811
    """A Mirror as the daemon runs it, scan by scan, in this process, writing to Azurite."""
    monkeypatch.syspath_prepend(str(REMOTE))  # as on the cluster: the tools import each other by file name
    checkpoint_mirror = importlib.import_module("checkpoint_mirror")
    container = importlib.import_module("upload_results").Container(azurite.url.rstrip("/"), "results")
    container.sas = container_sas(WRITE_ONLY)
    state = str(tmp_path / "state.json")
    return checkpoint_mirror, checkpoint_mirror.Mirror(str(directory), prefix, lambda: container, state, clock=clock)


def _after_a_clock_tick(path) -> None:
    """Until the file system's clock (coarse: a jiffy) has moved past path's last write, as it has by the
    time any real writer renames its file: then a rename leaves a change time after the write."""
    written = path.stat().st_mtime_ns
    probe = path.parent / ".probe"

    def ticked() -> bool:
        probe.write_bytes(b"")
        return probe.stat().st_mtime_ns > written

    wait_for(ticked, 10, "the file system's clock to tick")
    probe.unlink()


def test_a_file_is_mirrored_once_renamed_into_place_or_quiet_for_the_span_and_each_version_once(
    azurite,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    later = [0.0]  # seconds the mirror's clock runs ahead: the quiet span without waiting for it
    checkpoint_mirror, mirror = _mirror_in_process(
        azurite, tmp_path, monkeypatch, ckpt, "m0", lambda: time.time() + later[0]
    )
    paused = ckpt / "paused.bin"
    paused.write_bytes(b"x" * 1000)  # its writer pauses for longer than a scan, then goes on
    later[0] = checkpoint_mirror.QUIET_S - 30
    assert mirror.run_pass() == {} and blob_names(azurite, "m0/") == set()  # unchanged, but not for long
    later[0] = checkpoint_mirror.QUIET_S + 1
    assert mirror.run_pass() == {} and blob_names(azurite, "m0/") == {"m0/paused.bin"}  # quiet for the span
    mirror.run_pass()  # the same version is not sent again
    assert checkpoint_mirror.load_state(str(tmp_path / "state.json"))["paused.bin"] == mirror.uploaded["paused.bin"]
    later[0] = 0.0
    temporary = ckpt / ".renamed.bin.tmp"
    temporary.write_bytes(b"y" * 1000)
    _after_a_clock_tick(temporary)
    os.replace(temporary, ckpt / "renamed.bin")  # its writer says it is complete
    assert mirror.run_pass() == {} and blob_names(azurite, "m0/") == {"m0/paused.bin", "m0/renamed.bin"}
    assert azurite.get_container_client("results").download_blob("m0/paused.bin").readall() == b"x" * 1000
    assert sorted(p.name for p in ckpt.iterdir()) == ["paused.bin", "renamed.bin"]  # nothing of ours there


def test_symbolic_links_are_never_followed_and_each_is_said_once(azurite, tmp_path, monkeypatch, capsys):  # noqa: F811
    dataset = tmp_path / "dataset"
    (dataset / "train").mkdir(parents=True)
    (dataset / "train" / "0.jpg").write_bytes(b"image")
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"model")
    (ckpt / "data").symlink_to(dataset)
    (ckpt / "image.jpg").symlink_to(dataset / "train" / "0.jpg")
    _, mirror = _mirror_in_process(azurite, tmp_path, monkeypatch, ckpt, "m3", lambda: time.time() + 1e6)
    for _ in range(2):
        assert mirror.run_pass() == {}
    assert blob_names(azurite, "m3/") == {"m3/model.pt"}
    out = capsys.readouterr().out
    assert out.count("data skipped: a symbolic link") == 1 and out.count("image.jpg skipped: a symbolic link") == 1
    linked = tmp_path / "linked"
    linked.symlink_to(dataset)  # $CHECKPOINT_DIR itself a link: its target is not the job's to copy
    _, mirror = _mirror_in_process(azurite, tmp_path, monkeypatch, linked, "m4", lambda: time.time() + 1e6)
    for _ in range(2):
        assert mirror.run_pass(every=True) == {}
    assert blob_names(azurite, "m4/") == set()
    assert capsys.readouterr().out.count(f"{linked} is a symbolic link, to {dataset}: not mirrored") == 1


def test_names_come_back_byte_for_byte(azurite, tmp_path):  # noqa: F811
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    names = [b"back\\slash.bin", b"trailing.", b"pct%41.bin", b"caf\xe9.bin", b"sub dir/a+b=c?.pt", b"ckpt-0000000001"]
    for name in names:
        path = os.path.join(os.fsencode(ckpt), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(name)
    credential = ["--sas-file", str(sas_file(tmp_path, container_sas(WRITE_ONLY)))]
    container = ["--account-url", azurite.url.rstrip("/"), "--container", "results"]
    flags = ["--dir", str(ckpt), "--prefix", "m5/checkpoints", "--state", str(tmp_path / "sent.json")]
    once = run_tool("checkpoint_mirror.py", *flags, *container, *credential, "--once")
    assert once.returncode == 0, once.stderr
    dest = tmp_path / "fetched"
    read = ["--sas-file", str(sas_file(tmp_path, container_sas(READ_ONLY)))]
    got = run_tool("fetch_checkpoint.py", "--run", "m5", "--dest", str(dest), *container, *read)
    assert got.returncode == 0, got.stderr
    fetched = {
        os.path.relpath(os.path.join(root, name), os.fsencode(dest))
        for root, _, files in os.walk(os.fsencode(dest))
        for name in files
    }
    assert fetched == set(names)
    assert all(Path(os.fsdecode(os.path.join(os.fsencode(dest), name))).read_bytes() == name for name in names)


def test_the_mirror_daemon_copies_renamed_files_never_temporary_ones(azurite, tmp_path):  # noqa: F811
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    flags = ["--dir", str(ckpt), "--prefix", "m1/checkpoints", "--state", str(tmp_path / "sent.json")]
    flags += ["--account-url", azurite.url.rstrip("/")]
    flags += ["--container", "results", "--sas-file", str(sas_file(tmp_path, container_sas(WRITE_ONLY)))]
    (ckpt / ".state.pt.tmp").write_bytes(b"half")  # on its way: a hidden name
    (ckpt / ".step-0000000001.tmp-x").mkdir()
    (ckpt / ".step-0000000001.tmp-x" / "shard.distcp").write_bytes(b"half")
    mirror = subprocess.Popen(
        [sys.executable, str(REMOTE / "checkpoint_mirror.py"), *flags, "--interval", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        os.replace(ckpt / ".state.pt.tmp", ckpt / "state.pt")  # renamed into place: complete
        wait_for(lambda: blob_names(azurite, "m1/") == {"m1/checkpoints/state.pt"}, 30, "state.pt", interval=0.2)
    finally:
        mirror.send_signal(signal.SIGTERM)
        out = mirror.communicate(timeout=30)[0]
    assert mirror.returncode == 0, out
    assert "[job] checkpoint mirror: state.pt (0.0 MB) is in the results container" in out
    # --once sends what is new since (stable or not), and nothing sent before; temporary names never
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "last.pt").write_bytes(b"last")
    once = run_tool("checkpoint_mirror.py", *flags, "--once")
    assert once.returncode == 0, once.stderr
    assert once.stdout.decode().count("is in the results container") == 1
    assert blob_names(azurite, "m1/") == {"m1/checkpoints/state.pt", "m1/checkpoints/sub/last.pt"}


def test_a_refused_credential_is_reported_per_file_and_the_job_goes_on(azurite, tmp_path):  # noqa: F811
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "a.pt").write_bytes(b"a")
    flags = ["--dir", str(ckpt), "--prefix", "m2", "--state", str(tmp_path / "sent.json")]
    flags += ["--account-url", azurite.url.rstrip("/"), "--container", "results"]
    sas = ["--sas-file", str(sas_file(tmp_path, container_sas(READ_ONLY)))]
    once = run_tool("checkpoint_mirror.py", *flags, *sas, "--once")
    error = once.stderr.decode()
    assert once.returncode == 1 and error.startswith("checkpoint_mirror: error: a.pt not uploaded: "), error
    assert "lacks write permission" in error and "sig=" not in error


def test_fetch_brings_the_newest_of_our_checkpoints_or_every_file_of_other_code(azurite, tmp_path):  # noqa: F811
    container = azurite.get_container_client("results")
    kept = {
        "ours/checkpoints/ckpt-0000000010.ckpt": b"old",
        "ours/checkpoints/ckpt-0000000020.ckpt": b"new" * 1000,
        "theirs/checkpoints/model.pt": os.urandom(3000),
        "theirs/checkpoints/opt/state.pt": b"",
    }
    for name, data in kept.items():
        container.upload_blob(name, data, overwrite=True)
    read_only = ["--sas-file", str(sas_file(tmp_path, container_sas(READ_ONLY)))]
    base = ["--account-url", azurite.url.rstrip("/"), "--container", "results", *read_only]
    for run, expected in (("ours", {"ckpt-0000000020.ckpt"}), ("theirs", {"model.pt", "opt/state.pt"})):
        dest = tmp_path / run
        got = run_tool("fetch_checkpoint.py", "--run", run, "--dest", str(dest), *base)
        assert got.returncode == 0, got.stderr
        files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
        assert files == expected
        for name in expected:
            assert (dest / name).read_bytes() == kept[f"{run}/checkpoints/{name}"]
    assert got.stdout.decode() == f"fetched 2 files (0.0 MB) of theirs's checkpoints into {tmp_path / 'theirs'}\n"
    none = run_tool("fetch_checkpoint.py", "--run", "nothing", "--dest", str(tmp_path / "n"), *base)
    assert none.returncode == 2 and "holds no checkpoint of run nothing" in none.stderr.decode()


CATCHES_LATE = """
import signal, sys, time
time.sleep(1.5)  # still importing when the warning comes
signal.signal(signal.SIGUSR1, lambda *_: (open(sys.argv[1], "w").write("saved"), sys.exit(0)))
time.sleep(30)
"""


def test_the_warning_reaches_a_process_of_the_job_that_catches_it_late(tmp_path):
    job = f"test-{os.getpid()}"
    marker = tmp_path / "saved"
    env = {**os.environ, "SLURM_JOB_ID": job}
    # the run's remote/ directory, as submit.py fills it: the Spot agent beside the job tools
    tools = tmp_path / "remote"
    tools.mkdir()
    for tool in (REMOTE / "time_warning.py", REMOTE.parent / "boot" / "spot_agent.py"):
        shutil.copy(tool, tools)
    warn = [sys.executable, str(tools / "time_warning.py"), "--job", job]
    here = {**os.environ, "SLURMD_NODENAME": "node-7"}
    rank = subprocess.Popen([sys.executable, "-c", CATCHES_LATE, str(marker)], env=env)
    try:
        # --skip names pids of another node (the batch script's): not this one's
        elsewhere = ["--skip", str(rank.pid), "--skip-on", "node-0"]
        sent = subprocess.run([*warn, *elsewhere, "--within", "10"], capture_output=True, timeout=60, env=here)
        assert sent.returncode == 0 and sent.stdout == b"node-7 1\n", sent
        assert rank.wait(timeout=10) == 0 and marker.read_text() == "saved"
    finally:
        rank.kill()
    nobody = subprocess.run([*warn, "--within", "0"], capture_output=True, timeout=60, env=here)
    assert nobody.returncode == 0 and nobody.stdout == b"node-7 0\n", nobody
    # the job log's one line, from the nodes' reports (node-2's never came)
    summarize = [sys.executable, str(tools / "time_warning.py"), "--summarize", "3"]
    some = subprocess.run(summarize, input=b"node-7 1\nnode-1 0\n", capture_output=True, timeout=60)
    assert some.stdout.decode() == "[job] time warning: SIGUSR1 sent to 1 processes on 1 of 3 node(s) (node-7)\n"
    none = subprocess.run(summarize, input=b"node-1 0\n", capture_output=True, timeout=60)
    assert "no process catches SIGUSR1 on the job's 3 node(s)" in none.stdout.decode()


# catches SIGUSR1 (a forwarder, or a rank), says it is ready, and records a warning it gets
CATCHES = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1], "w").write("warned"))
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("forwarder", ["srun", "docker"])
def test_the_warning_skips_the_processes_that_would_pass_it_on_to_tasks_without_a_handler(forwarder, tmp_path):
    """srun and docker's client catch SIGUSR1 only to pass it on to a step's tasks (a container), which a
    starting step may not have set their handler in yet: the ranks below them are signalled themselves."""
    job = f"test-{os.getpid()}"
    env = {**os.environ, "SLURM_JOB_ID": job}
    (tmp_path / forwarder).symlink_to(sys.executable)  # a process whose name (comm) is the forwarder's
    started = [
        subprocess.Popen(
            [str(path), "-c", CATCHES, str(tmp_path / f"{path.name}.warned")], env=env, stdout=subprocess.PIPE
        )
        for path in (tmp_path / forwarder, Path(sys.executable))
    ]
    try:
        assert all(process.stdout.readline() == b"ready\n" for process in started)
        assert signal_ranks(job) == [started[1].pid]
        rank_marker = tmp_path / f"{Path(sys.executable).name}.warned"
        wait_for(rank_marker.exists, 10, "the rank to record the warning")
        assert not (tmp_path / f"{forwarder}.warned").exists()
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_warn_before_reads_units_and_stays_inside_the_time_limit():
    assert [parse_lead(t) for t in ("90", "90s", "5m", "1h", "0")] == [90, 90, 300, 3600, 0]
    for bad in ("5x", "-1", "", "1.5m"):
        with pytest.raises(OperatorError, match="invalid --warn-before"):
            parse_lead(bad)
    with pytest.raises(OperatorError, match="too long: Slurm signals at most 65535 s"):
        parse_lead("19h")
    assert warning_lead(None, "4:00:00") == 300 and warning_lead(None, "1") == 30
    assert warning_lead(None, "INFINITE") == 300 and warning_lead(600, "2:00:00") == 600
    with pytest.raises(OperatorError, match=r"--warn-before 600s is not shorter than the time limit \(10\)"):
        warning_lead(600, "10")


def test_the_results_upload_makes_the_mirrors_last_pass_before_the_status(azurite, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"last")
    (run / "status.json").write_text('{"exit_code": 0, "results": "uploading"}\n')
    flags = ["--dir", str(run), "--prefix", "u1", "--account-url", azurite.url.rstrip("/"), "--container", "results"]
    sas = ["--sas-file", str(sas_file(tmp_path, container_sas(WRITE_ONLY)))]
    done = run_tool("upload_results.py", *flags, *sas, "--status", "status.json", "--with-checkpoints")
    assert done.returncode == 0, done.stderr
    assert blob_names(azurite, "u1/") == {"u1/checkpoints/last.pt", "u1/status.json"}
    assert "checkpoint last.pt (0.0 MB) is in the results container" in done.stdout.decode()
    assert json.loads((run / "status.json").read_text())["results"] == "uploaded"


def test_the_last_pass_of_a_job_that_failed_names_a_file_its_writer_left_unfinished(azurite, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "torn.pt").write_bytes(b"half")  # being written when the time limit came
    # written in place a minute before the end (a warned job's checkpoint): finished with, so it goes
    (run / "checkpoints" / "warned.pt").write_bytes(b"whole")
    a_minute_ago = time.time() - 60
    os.utime(run / "checkpoints" / "warned.pt", (a_minute_ago, a_minute_ago))
    temporary = run / "checkpoints" / ".saved.pt.tmp"
    temporary.write_bytes(b"saved")
    _after_a_clock_tick(temporary)
    os.replace(temporary, run / "checkpoints" / "saved.pt")
    (run / "status.json").write_text('{"exit_code": 143, "results": "uploading"}\n')
    flags = ["--dir", str(run), "--prefix", "u2", "--account-url", azurite.url.rstrip("/"), "--container", "results"]
    sas = ["--sas-file", str(sas_file(tmp_path, container_sas(WRITE_ONLY)))]
    done = run_tool("upload_results.py", *flags, *sas, "--status", "status.json", "--with-checkpoints")
    assert done.returncode == 1, done.stderr
    assert blob_names(azurite, "u2/") == {"u2/checkpoints/saved.pt", "u2/checkpoints/warned.pt", "u2/status.json"}
    assert json.loads((run / "status.json").read_text())["not_uploaded"] == ["checkpoints/torn.pt"]
    why = r"checkpoints/torn.pt not uploaded: last written \d+ s before the job ended and not renamed into place"
    assert re.search(why, done.stderr.decode()), done.stderr.decode()


# --- launch --resume-from's check, on the operator's side ----------------------------------------
def test_a_bundled_job_resumes_only_from_our_trainings_checkpoints(azurite, tmp_path, monkeypatch):  # noqa: F811
    """Our training (no --workdir, no --entrypoint) finds ckpt-<step>.ckpt or step-<step>/ alone: another
    code's files were fetched, every one of them, then it trained from step 0 without a word."""
    results = azurite.get_container_client("results")
    kept = {
        "other-code": ["state.bin", "optim/adam.pt"],
        "our-run": ["ckpt-0000000010.ckpt", "notes.txt"],
        "our-mp-run": ["step-0000000010/.metadata", "step-0000000010/__0_0.distcp"],
    }
    for run, names in kept.items():
        for name in names:
            results.upload_blob(f"{run}/checkpoints/{name}", b"x", overwrite=True)
    desc = from_stack_outputs(OUTPUTS, "dev", private_key_file(tmp_path), known_hosts=tmp_path / "kh")
    location = BlobLocation(
        endpoint=azurite.url.rstrip("/"),
        container="results",
        credential=BlobCredential(kind="sas", secret=SecretStr(container_sas(READ_ONLY))),
    )
    desc = desc.model_copy(update={"results": location})
    with pytest.raises(OperatorError) as refused:
        require_kept_checkpoint(desc, "other-code", ours=True)
    assert str(refused.value).startswith(
        "--resume-from other-code: its checkpoints are not our training's (ckpt-<step>.ckpt or step-<step>/, e.g. "
    ), refused.value
    assert "resume that run's own code (--workdir or --entrypoint)" in str(refused.value)
    require_kept_checkpoint(desc, "other-code", ours=False)  # your own code reads its own files
    for run in ("our-run", "our-mp-run"):
        require_kept_checkpoint(desc, run, ours=True)
    with pytest.raises(OperatorError, match="holds no checkpoint of that run"):
        require_kept_checkpoint(desc, "our", ours=True)  # a prefix of a run's name is not that run
    monkeypatch.syspath_prepend(str(REMOTE))  # the names the job's fetch takes for ours, the same
    assert importlib.import_module("fetch_checkpoint").OURS.pattern == OUR_CHECKPOINT.pattern


def test_the_last_pass_takes_a_job_that_exited_after_saving_its_checkpoint_as_done_writing():
    """upload_results.py runs on the hosts without the operator's package: its copy of the exit code that
    says "checkpoint saved, then exited" (a warning, an eviction) must be the contract's."""
    from dtrain.remote.job.upload_results import WRITERS_DONE_EXIT_CODES
    from infra.contract import PREEMPTED_EXIT_CODE

    assert set(WRITERS_DONE_EXIT_CODES) == {0, PREEMPTED_EXIT_CODE}
