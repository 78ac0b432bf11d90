"""The checkpoint job tools, run as the cluster runs them (`python3 FILE`, outside any package), against a
real Azurite: checkpoint_mirror.py uploads complete files only, fetch_checkpoint.py brings a run's newest
checkpoint back with a read-only SAS, time_warning.py passes SIGUSR1 on to a process that catches it
late; and `launch --warn-before`'s rules."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from azure.storage.blob import ContainerSasPermissions

from dtrain.errors import OperatorError
from dtrain.jobs.time_warning import parse_lead, warning_lead
from dtrain.remote.boot.spot_agent import signal_ranks
from tests.polling import wait_for

from .test_remote_tools import REMOTE, azurite, container_sas, run_tool, sas_file  # noqa: F401 (a fixture)

READ_ONLY = ContainerSasPermissions(read=True, list=True)
WRITE_ONLY = ContainerSasPermissions(create=True, write=True)


def blob_names(service, prefix: str) -> set[str]:
    return {b.name for b in service.get_container_client("results").list_blobs(name_starts_with=prefix)}


def test_a_file_is_mirrored_once_it_stops_changing_and_each_version_once(azurite, tmp_path, monkeypatch):  # noqa: F811
    """Scan by scan, in process (the pass the daemon runs every 10 s)."""
    monkeypatch.syspath_prepend(str(REMOTE))  # as on the cluster: the tools import each other by file name
    checkpoint_mirror = importlib.import_module("checkpoint_mirror")
    upload_results = importlib.import_module("upload_results")
    container = upload_results.Container(azurite.url.rstrip("/"), "results")
    container.sas = container_sas(WRITE_ONLY)
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    state = tmp_path / "state.json"
    mirror = checkpoint_mirror.Mirror(str(ckpt), "m0", lambda: container, str(state))
    growing = ckpt / "growing.bin"
    for size in (1000, 2000):  # still being written: changed since the scan before
        growing.write_bytes(b"x" * size)
        assert mirror.run_pass() == {} and blob_names(azurite, "m0/") == set()
    assert mirror.run_pass() == {} and blob_names(azurite, "m0/") == {"m0/growing.bin"}  # stable: sent
    mirror.run_pass()  # the same version is not sent again
    assert azurite.get_container_client("results").download_blob("m0/growing.bin").readall() == b"x" * 2000
    assert checkpoint_mirror.load_state(str(state)) == {"growing.bin": mirror.uploaded["growing.bin"]}
    assert sorted(p.name for p in ckpt.iterdir()) == ["growing.bin"]  # nothing of ours in the job's directory


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
