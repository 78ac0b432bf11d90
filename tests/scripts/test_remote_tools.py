"""The job-side tools in dtrain/remote/: annotate_output.py, job_secrets.py, upload_results.py, srun_ssh.py.

Real components wherever they run here: horovodrun and torchrun from the training environment (their
real output is what gets annotated; `srun --label`'s `N: ` is added the way srun adds it), Azurite for
the uploads, horovod's own ssh command builder for srun_ssh's parsing. The IMDS token endpoint is a
small local HTTP server (Azure's cannot be reached from here). The whole chain under a real Slurm
(sbatch -> horovodrun -> srun_ssh.py -> srun) belongs to the local cluster's tests.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar

import pytest
from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

from dtrain.local.daemons import free_port, wait_port
from dtrain.processes import stop_process_group
from dtrain.remote.job import annotate_output, srun_ssh, upload_results
from dtrain.remote.job.job_secrets import SecretMask, parse_secrets, render_secrets
from tests.local_http import reply_json, serving

REPO = Path(__file__).resolve().parents[2]
REMOTE = REPO / "dtrain" / "remote" / "job"
TRAIN_BIN = REPO / ".venv-train" / "bin"
AZURITE = REPO / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft; not a secret).
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def run_tool(name: str, *args: str, stdin: bytes = b"", env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a remote tool as the cluster does: `python3 FILE args`, outside any package."""
    return subprocess.run(
        [sys.executable, str(REMOTE / name), *args],
        input=stdin,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


# --- annotate_output.py ------------------------------------------------------------------------
def annotate_text(launcher: str, text: str, hosts: list[str], slots: int, tmp_path: Path) -> tuple[list[str], dict]:
    """Feed text through the annotator (in process); returns (output lines, verdict)."""
    kind = annotate_output.HorovodrunOutput if launcher == "horovodrun" else annotate_output.TorchrunOutput
    verdict = annotate_output.Verdict()
    out = io.StringIO()
    logs = annotate_output.RankLogs(str(tmp_path))
    annotate_output.annotate(io.BytesIO(text.encode()), out, kind(hosts, slots, verdict), logs, SecretMask(()))
    logs.close()
    return out.getvalue().splitlines(), verdict.as_dict()


def write_script(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


HOROVOD_JOB = """
import sys, time
import horovod.torch as hvd
hvd.init()
r = hvd.rank()
print(f"hello from {r}", flush=True)
print(f"warning from {r}", file=sys.stderr, flush=True)
if r == 1:
    print("error: rank 1 fails on purpose", flush=True)
    sys.exit(5)
time.sleep(5)
"""


def test_real_horovodrun_output_is_annotated_logged_per_rank_and_judged(tmp_path):
    job = write_script(tmp_path / "job.py", HOROVOD_JOB)
    launcher = subprocess.run(
        [str(TRAIN_BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", str(TRAIN_BIN / "python"), str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=120,
    )
    assert launcher.returncode != 0
    run = tmp_path / "run"
    args = ["--launcher", "horovodrun", "--hosts", "node-0", "--slots", "2"]
    args += ["--logs-dir", str(run / "logs"), "--verdict", str(run / "verdict.json")]
    result = run_tool("annotate_output.py", *args, stdin=launcher.stdout)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert len(lines) == len(launcher.stdout.decode().splitlines())  # every line kept
    assert "[0|node-0] hello from 0" in lines and "[1|node-0] hello from 1" in lines
    assert "[1|node-0]! warning from 1" in lines
    assert "[horovodrun] Process 1 exit with status code 5." in lines
    assert "[horovodrun] Process name: 1" in lines  # horovodrun's closing traceback stays in the log
    assert all(line.startswith(("[0|node-0]", "[1|node-0]", "[horovodrun] ")) for line in lines)
    assert json.loads((run / "verdict.json").read_text()) == {
        "failed_rank": 1,
        "failed_host": "node-0",
        "exit_code_of_failed_rank": 5,
        "job_error": "rank 1 fails on purpose",
    }
    rank1 = (run / "logs" / "rank-1.log").read_text().splitlines()
    assert sorted(rank1) == ["error: rank 1 fails on purpose", "hello from 1", "warning from 1"]
    assert "hello from 1" not in (run / "logs" / "rank-0.log").read_text()


def test_horovodrun_ranks_map_to_hosts_by_slots_and_the_closing_block_names_the_first_failure(tmp_path):
    text = "\n".join(
        [
            "Sun Nov 23 02:07:12 2026[0]<stdout>:step 1",  # --prefix-timestamp
            "[3]<stderr>:boom",
            "[2]<stdout>:10%\r[2]<stdout>:20%\r",  # a progress bar: one log line per piece
            "[5]<stdout>:out of the hostfile",
            "Process 3 exit with status code -9.",
            "Process 2 exit with status code 1.",
            "Process name: 2",
            "Exit code: 1",
        ]
    )
    lines, verdict = annotate_text("horovodrun", text, ["node-0", "node-1"], 2, tmp_path)
    assert lines[:5] == [
        "[0|node-0] step 1",
        "[3|node-1]! boom",
        "[2|node-1] 10%",
        "[2|node-1] 20%",
        "[5|?] out of the hostfile",
    ]
    assert lines[5:] == [
        "[horovodrun] Process 3 exit with status code -9.",
        "[horovodrun] Process 2 exit with status code 1.",
        "[horovodrun] Process name: 2",
        "[horovodrun] Exit code: 1",
    ]
    # horovodrun's closing block is its judgement of the first failure, not the first line it printed
    assert verdict == {"failed_rank": 2, "failed_host": "node-1", "exit_code_of_failed_rank": 1, "job_error": None}
    assert (tmp_path / "rank-2.log").read_text() == "10%\n20%\n"


def test_a_killed_rank_reads_as_the_shell_reports_it_and_the_jobs_own_error_line_is_kept(tmp_path):
    text = "[1]<stdout>:step 5/8\n[0]<stderr>:error: rank 1 on host node-1 stopped answering\n"
    text += "Process 1 exit with status code -9.\n"
    _, verdict = annotate_text("horovodrun", text, ["node-0", "node-1"], 1, tmp_path)
    assert verdict == {
        "failed_rank": 1,
        "failed_host": "node-1",
        "exit_code_of_failed_rank": 137,
        "job_error": "rank 1 on host node-1 stopped answering",
    }
    assert [annotate_output.normalize_exit(c) for c in (None, 0, 3, -15, 256)] == [1, 0, 3, 143, 1]


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_the_rank_that_died_is_blamed_not_the_rank_that_noticed_and_exited_first(tmp_path, launcher):
    """Rank 1 (node-1) was SIGKILLed; rank 0 noticed, named it, and was the first process to exit."""
    error = "error: rank 1 on host node-1 has exited; rank 0 on host node-0 noticed: Connection reset by peer"
    if launcher == "horovodrun":
        text = f"[0]<stderr>:{error}\nProcess 0 exit with status code 1.\nProcess name: 0\nExit code: 1\n"
    else:
        text = f"0: @rank0@{error}\n0: Root Cause (first observed failure):\n0:   rank      : 0 (local_rank: 0)\n"
        text += "0:   exitcode  : 1 (pid: 42)\n"
    _, verdict = annotate_text(launcher, text, ["node-0", "node-1"], 1, tmp_path)
    assert (verdict["failed_rank"], verdict["failed_host"], verdict["exit_code_of_failed_rank"]) == (1, "node-1", 1)


TORCH_JOB = """
import datetime, os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
r = dist.get_rank()
print(f"rank {r} on node {os.environ['NODE_INDEX']}", flush=True)
if r == 1:
    print("error: rank 1 gives up", flush=True)
    os._exit(4)
time.sleep(2)  # rank 1's node reports first, as a node whose rank failed does
dist.barrier()
"""


def srun_label(procs: list[subprocess.Popen]) -> str:
    """What `srun --label` makes of its tasks' output: `N: ` in front of each line, in arrival order."""
    lines: list[str] = []
    lock = threading.Lock()

    def read(index: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                lines.append(f"{index}: {line}")

    readers = [threading.Thread(target=read, args=(i, p)) for i, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    for reader, proc in zip(readers, procs, strict=True):
        reader.join(timeout=120)
        proc.wait(timeout=10)
    return "".join(lines)


def test_real_torchrun_on_two_nodes_is_attributed_by_global_rank_and_its_root_cause_judged(tmp_path):
    job = write_script(tmp_path / "job.py", TORCH_JOB)
    port = free_port()
    procs = []
    for node in range(2):  # one torchrun per node, as `srun --ntasks-per-node=1` starts them
        argv = [str(TRAIN_BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        argv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job1", "--tee", "3", str(job)]
        env = {**os.environ, "NODE_INDEX": str(node)}
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = annotate_output.TORCHRUN_PREFIX_TEMPLATE
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    labeled = srun_label(procs)
    lines, verdict = annotate_text("torchrun", labeled, ["node-0", "node-1"], 1, tmp_path)
    # c10d numbers the nodes its own way: the rank comes from torchrun's prefix, the host from srun's label
    for rank in (0, 1):
        [own] = [line for line in lines if line.startswith(f"[{rank}|") and " on node " in line]
        node = own.rsplit(" ", 1)[1]
        assert own == f"[{rank}|node-{node}] rank {rank} on node {node}"
    node_of_rank1 = next(line for line in lines if line.startswith("[1|")).split("|")[1].split("]")[0]
    assert f"[torchrun@{node_of_rank1}] Root Cause (first observed failure):" in lines
    assert verdict == {
        "failed_rank": 1,
        "failed_host": node_of_rank1,
        "exit_code_of_failed_rank": 4,
        "job_error": "rank 1 gives up",
    }
    assert (tmp_path / "rank-1.log").read_text().splitlines()[-1] == "error: rank 1 gives up"
    assert len(lines) == len(labeled.splitlines())


def test_torchrun_lines_run_together_are_split_and_interleaved_summaries_read_per_node(tmp_path):
    text = "\n".join(
        [
            "00: @rank0@last words@rank1@hello",  # rank 0 ended without a newline
            "01: @rank2@[rank2]: Traceback (most recent call last):",  # PyTorch's own prefix is text
            "01: Root Cause (first observed failure):",
            "00: W1123 02:07:12.486000 20417 torch/distributed/run.py:874] a warning",
            "01: [0]:",
            "01:   rank      : 2 (local_rank: 0)",
            "00: Root Cause (first observed failure):",
            "00:   rank      : 0 (local_rank: 0)",
            "01:   exitcode  : -11 (pid: 20519)",
            "00:   exitcode  : 1 (pid: 20518)",
            "srun: error: node-1: task 1: Exited with exit code 1",
        ]
    )
    lines, verdict = annotate_text("torchrun", text, ["node-0", "node-1"], 2, tmp_path)
    assert lines[:4] == [
        "[0|node-0] last words",
        "[1|node-0] hello",
        "[2|node-1] [rank2]: Traceback (most recent call last):",
        "[torchrun@node-1] Root Cause (first observed failure):",
    ]
    assert "[torchrun] srun: error: node-1: task 1: Exited with exit code 1" in lines
    assert verdict == {"failed_rank": 2, "failed_host": "node-1", "exit_code_of_failed_rank": 139, "job_error": None}


def test_without_a_torchrun_summary_sruns_task_exit_names_the_host(tmp_path):
    text = "0: @rank0@step 1\n1: @rank1@step 1\nsrun: error: node-1: task 1: Exited with exit code 9\n"
    _, verdict = annotate_text("torchrun", text, ["node-0", "node-1"], 1, tmp_path)
    assert verdict == {"failed_rank": None, "failed_host": "node-1", "exit_code_of_failed_rank": 9, "job_error": None}


def test_a_clean_run_has_an_empty_verdict_and_bad_arguments_a_clear_error(tmp_path):
    def args(verdict: Path, slots: str = "1") -> list[str]:
        logs = str(tmp_path / "logs")
        return [
            "--launcher",
            "torchrun",
            "--hosts",
            "node-0",
            "--slots",
            slots,
            "--logs-dir",
            logs,
            "--verdict",
            str(verdict),
        ]

    verdict = tmp_path / "verdict.json"
    result = run_tool("annotate_output.py", *args(verdict), stdin=b"0: @rank0@ok\n")
    assert result.returncode == 0 and result.stdout == b"[0|node-0] ok\n"
    assert json.loads(verdict.read_text()) == dict.fromkeys(
        ("failed_rank", "failed_host", "exit_code_of_failed_rank", "job_error")
    )
    nowhere = tmp_path / "missing" / "verdict.json"
    result = run_tool("annotate_output.py", *args(nowhere), stdin=b"0: @rank0@ok\n")
    assert result.returncode == 1 and result.stdout == b"[0|node-0] ok\n"  # the log first, whatever happens
    assert result.stderr.decode() == f"annotate_output: error: {nowhere}: No such file or directory\n"
    bad = run_tool("annotate_output.py", *args(verdict, slots="0"))
    assert bad.returncode == 2 and b"argument --slots: expected a whole number of at least 1" in bad.stderr
    assert b"Traceback" not in bad.stderr
    bad = run_tool("annotate_output.py", "--launcher", "mpirun", "--hosts", "a", "--slots", "1", "--logs-dir", "x")
    assert bad.returncode == 2 and b"invalid choice: 'mpirun'" in bad.stderr


def test_scancels_sigterm_does_not_cut_the_log_short(tmp_path):
    verdict = tmp_path / "verdict.json"
    argv = [sys.executable, str(REMOTE / "annotate_output.py"), "--launcher", "horovodrun", "--hosts", "n0"]
    argv += ["--slots", "1", "--logs-dir", str(tmp_path), "--verdict", str(verdict)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"[0]<stdout>:before\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"[0|n0] before\n"  # flushed line by line
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.stdin.write(b"[0]<stderr>:Terminated\nProcess 0 exit with status code 143.\n")
    proc.stdin.close()
    assert proc.stdout.read() == b"[0|n0]! Terminated\n[horovodrun] Process 0 exit with status code 143.\n"
    assert proc.wait(timeout=10) == 0
    assert json.loads(verdict.read_text())["exit_code_of_failed_rank"] == 143


def test_the_secrets_values_are_masked_in_the_log_the_rank_logs_and_the_verdict(tmp_path):
    key = "-----BEGIN KEY-----\nkey-line-a\nkey-line-b\n-----END KEY-----"
    (tmp_path / "env").write_bytes(render_secrets({"HF_TOKEN": "tok-123", "PEM": key}))
    args = ["--launcher", "torchrun", "--hosts", "node-0", "--slots", "2", "--logs-dir", str(tmp_path / "logs")]
    args += ["--verdict", str(tmp_path / "verdict.json"), "--secrets", str(tmp_path / "env")]
    printed = "".join(f"0: @rank1@{line}\n" for line in key.splitlines())
    text = f"0: @rank0@token=tok-123!\n{printed}0: @rank0@error: tok-123 refused\n0: @rank1@all fine\n"
    result = run_tool("annotate_output.py", *args, stdin=text.encode())
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().splitlines() == [
        "[0|node-0] token=***!",
        *["[1|node-0] ***"] * 4,
        "[0|node-0] error: *** refused",
        "[1|node-0] all fine",
    ]
    assert (tmp_path / "logs" / "rank-1.log").read_text() == "***\n" * 4 + "all fine\n"
    assert json.loads((tmp_path / "verdict.json").read_text())["job_error"] == "*** refused"


# --- job_secrets.py ----------------------------------------------------------------------------
HARD_VALUES = {
    "newlines": "line 1\nline 2\n\n",
    "quotes": "it's \"quoted\" '' \"",
    "backslashes": "C:\\path\\ \\n \\",
    "shell": "$HOME `id` $(id) ; & | * ?",
    "unicode": "ünïcødé € 日本 \u2028 \x0b \r\n",
    "not UTF-8": "caf\udce9",  # the operator's environment held the byte 0xE9: os.environ's surrogateescape
    "empty": "",
    "equals": "a=b=c",
}


@pytest.mark.parametrize("value", HARD_VALUES.values(), ids=HARD_VALUES.keys())
def test_any_value_reads_back_the_same_in_sh_and_in_our_tools(value, tmp_path):
    """The secrets file as the user's command (sh) and our tools (mlflow_run.py, the mask) read it."""
    path = tmp_path / "env"
    path.write_bytes(render_secrets({"FIRST": value, "SECOND": "after"}))
    assert parse_secrets(path.read_bytes()) == {"FIRST": value, "SECOND": "after"}
    script = f'set -a; . {shlex.quote(str(path))}; set +a; printf "%s|%s" "$FIRST" "$SECOND"'
    shell = subprocess.run(["sh", "-c", script], capture_output=True, check=True)
    assert shell.stdout == value.encode("utf-8", "surrogateescape") + b"|after"


def test_the_mask_hides_each_value_whole_and_each_line_of_a_multi_line_one():
    mask = SecretMask(["abc", "abcdef", "  first line\r\nsecond\n\n   \n", "", "caf\udce9"])
    assert mask(b"abcdef abc ab\n") == b"*** *** ab\n"  # the longer value whole, not *** then def
    assert mask(b"[0|node-0]   first line\r\n") == b"[0|node-0]   ***\r\n"  # a line, without its blanks
    assert mask(b"second-hand\n") == b"***-hand\n"
    assert mask(b"   \n") == b"   \n"  # blank lines of a value are not masked
    assert mask(b"caf\xe9 cafe\n") == b"*** cafe\n"  # bytes as the environment held them
    assert SecretMask([])(b"abc\n") == b"abc\n"


def test_the_filter_masks_line_by_line_flushed_to_the_last_partial_line(tmp_path):
    (tmp_path / "env").write_bytes(render_secrets({"TOKEN": "tok-123"}))
    argv = [sys.executable, str(REMOTE / "job_secrets.py"), str(tmp_path / "env")]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"[setup] token tok-123\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"[setup] token ***\n"  # at once: a line is not held back
    proc.send_signal(signal.SIGTERM)  # scancel's: ignored, the last lines still come
    proc.stdin.write(b"last tok-123 without a newline")
    proc.stdin.close()
    assert proc.stdout.read() == b"last *** without a newline" and proc.wait(timeout=30) == 0
    gone = run_tool("job_secrets.py", str(tmp_path / "removed"), stdin=b"tok-123\n")  # removed: nothing to mask
    assert gone.returncode == 0 and gone.stdout == b"tok-123\n"


# --- upload_results.py -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlobServiceClient]:
    """A private Azurite on a free port, with an empty `results` container."""
    port = free_port()
    location = tmp_path_factory.mktemp("azurite")
    argv = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(location)]
    with open(location / "azurite.log", "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--skipApiVersionCheck", "--silent"], stdout=log, stderr=log, start_new_session=True
        )
    try:
        wait_port("127.0.0.1", port, 60, "Azurite", location / "azurite.log")
        endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
        service = BlobServiceClient(endpoint, credential={"account_name": ACCOUNT, "account_key": ACCOUNT_KEY})
        service.create_container("results")
        yield service
    finally:
        stop_process_group(proc)


def container_sas(permission: ContainerSasPermissions, container: str = "results") -> str:
    expiry = datetime.now(UTC) + timedelta(hours=1)
    return generate_container_sas(ACCOUNT, container, account_key=ACCOUNT_KEY, permission=permission, expiry=expiry)


def sas_file(directory: Path, sas: str) -> Path:
    path = directory / "results.sas"
    path.write_text(sas + "\n")
    path.chmod(0o600)
    return path


WRITE_ONLY = ContainerSasPermissions(create=True, write=True)


def make_run_dir(root: Path) -> Path:
    run = root / "run-1"
    for name, data in {
        "output.log": b"[0|node-0] hello\n",
        "metrics.json": b'{"images_per_second": 12.5}\n',
        "status.json": b'{"exit_code": 0}\n',
        "logs/rank-0.log": b"hello\n",
        "logs/rank-1.log": bytes(range(256)) * 10,
        "results.sas": b"sv=2021&sig=secret\n",
        "logs/other.sas": b"sig=secret\n",
        "checkpoints/step-1.pt": b"weights",
        "remote/upload_results.py": b"# a copy\n",
        "data/checkpoints/kept.txt": b"only the top-level checkpoints/ is skipped\n",
    }.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    (run / "logs" / "link.log").symlink_to(root / "outside.txt")
    (root / "outside.txt").write_text("not part of the run\n")
    return run


def test_a_run_directory_lands_under_its_prefix_without_checkpoints_tools_or_secrets(azurite, tmp_path):
    run = make_run_dir(tmp_path)
    sas = container_sas(WRITE_ONLY)
    url = azurite.url.rstrip("/")
    args = ["--dir", str(run), "--account-url", url, "--container", "results", "--prefix", "run-1"]
    result = run_tool("upload_results.py", *args, "--sas-file", str(sas_file(tmp_path, sas)))
    assert result.returncode == 0, result.stderr
    expected = {
        "output.log",
        "metrics.json",
        "status.json",
        "logs/rank-0.log",
        "logs/rank-1.log",
        "data/checkpoints/kept.txt",
    }
    size = sum((run / name).stat().st_size for name in expected)
    *progress, summary = result.stdout.decode().splitlines()
    assert summary == f"uploaded 6 files ({size / 1e6:.1f} MB) to {url}/results/run-1/"
    # progress with the totals and the rate, the last at 100%
    mb = re.escape(f"{size / 1e6:.1f}")
    assert re.fullmatch(rf"uploading results: 6/6 files, {mb}/{mb} MB \(100%\), [\d.]+ MB/s", progress[-1]), progress
    assert sas.split("sig=")[1] not in (result.stdout + result.stderr).decode()
    container = azurite.get_container_client("results")
    blobs = {b.name: b for b in container.list_blobs(name_starts_with="run-1/")}
    assert set(blobs) == {f"run-1/{name}" for name in expected}
    for name in expected:
        data = (run / name).read_bytes()
        assert container.download_blob(f"run-1/{name}").readall() == data
        assert bytes(blobs[f"run-1/{name}"].content_settings.content_md5) == hashlib.md5(data).digest()
    assert blobs["run-1/output.log"].content_settings.content_type == "text/plain; charset=utf-8"
    assert blobs["run-1/metrics.json"].content_settings.content_type == "application/json"


def test_the_status_file_goes_last_and_says_what_the_upload_came_to(azurite, tmp_path):
    run = make_run_dir(tmp_path)
    (run / "status.json").write_text('{"exit_code": 0, "results": "uploading"}\n')
    url = azurite.url.rstrip("/")
    args = ["--dir", str(run), "--account-url", url, "--container", "results", "--status", "status.json"]
    written = sas_file(tmp_path, container_sas(WRITE_ONLY))
    result = run_tool("upload_results.py", *args, "--prefix", "st", "--sas-file", str(written))
    assert result.returncode == 0, result.stderr
    container = azurite.get_container_client("results")
    uploaded = json.loads(container.download_blob("st/status.json").readall())
    assert uploaded == {"exit_code": 0, "results": "uploaded", "not_uploaded": []}
    assert json.loads((run / "status.json").read_text()) == uploaded  # the run directory's copy agrees
    # a credential that cannot write: nothing uploaded, and the run directory's copy says so
    refused = sas_file(tmp_path, container_sas(ContainerSasPermissions(read=True, list=True)))
    result = run_tool("upload_results.py", *args, "--prefix", "st-ro", "--sas-file", str(refused))
    assert result.returncode == 3
    local = json.loads((run / "status.json").read_text())
    assert local["results"] == "failed" and "lacks write permission" in local["results_error"]


def test_files_that_fail_are_named_and_the_others_still_go(azurite, tmp_path, monkeypatch):
    run = make_run_dir(tmp_path)
    container = upload_results.Container(azurite.url, "results")
    container.sas = container_sas(WRITE_ONLY)
    real = upload_results.upload_file

    def failing(target, path, blob, **kwargs):
        if blob.endswith("rank-1.log"):
            raise upload_results.UploadError("HTTP 503 ServerBusy (3 tries)")
        return real(target, path, blob, **kwargs)

    monkeypatch.setattr(upload_results, "upload_file", failing)
    count, _, failures = upload_results.upload_run(str(run), container, "partial", exclude=["status.json"])
    assert count == 4 and list(failures) == ["logs/rank-1.log"]
    upload_results.finish_status(str(run / "status.json"), failures)
    status = json.loads((run / "status.json").read_text())
    assert status["results"] == "incomplete" and status["not_uploaded"] == ["logs/rank-1.log"]


def test_a_read_only_sas_is_refused_with_a_clear_error_that_never_shows_the_sas(azurite, tmp_path):
    run = make_run_dir(tmp_path)
    sas = container_sas(ContainerSasPermissions(read=True, list=True))
    args = ["--dir", str(run), "--account-url", azurite.url, "--container", "results", "--prefix", "ro"]
    result = run_tool("upload_results.py", *args, "--sas-file", str(sas_file(tmp_path, sas)))
    assert result.returncode == 3
    error = result.stderr.decode()
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "cannot upload ro/data/checkpoints/kept.txt" in error  # the first file, by name
    assert "HTTP 403 AuthorizationPermissionMismatch" in error
    assert "the SAS lacks write permission on the container results" in error
    assert sas.split("sig=")[1] not in error


def test_files_beyond_the_single_put_limit_go_in_blocks_with_the_whole_files_md5(azurite, tmp_path):
    container = upload_results.Container(azurite.url, "results")
    container.sas = container_sas(WRITE_ONLY)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(2500))
    assert (
        upload_results.upload_file(container, str(big), "blocks/big.bin", single_put_limit=1000, block_size=300) == 2500
    )
    small = tmp_path / "small.bin"
    small.write_bytes(os.urandom(1000))
    assert upload_results.upload_file(container, str(small), "blocks/small.bin", single_put_limit=1000) == 1000
    client = azurite.get_container_client("results")
    big_blob = client.get_blob_client("blocks/big.bin")
    assert big_blob.download_blob().readall() == big.read_bytes()
    committed, _ = big_blob.get_block_list("committed")
    # 1001 bytes read to see the file is big: 300+300+300+101, then the other 1499 in 300s
    assert [b.size for b in committed] == [300, 300, 300, 101, 300, 300, 300, 300, 299]
    md5 = big_blob.get_blob_properties().content_settings.content_md5
    assert base64.b64encode(bytes(md5)).decode() == base64.b64encode(hashlib.md5(big.read_bytes()).digest()).decode()
    small_blob = client.get_blob_client("blocks/small.bin")
    assert small_blob.download_blob().readall() == small.read_bytes()
    assert small_blob.get_block_list("committed")[0] == []  # one Put Blob, no blocks


def upload_args(**given: str) -> list[str]:
    """upload_results.py's arguments: --name value for each given name (underscores as dashes)."""
    return [word for name, value in given.items() for word in (f"--{name.replace('_', '-')}", value)]


def test_a_missing_container_and_bad_arguments_are_clear_errors(azurite, tmp_path):
    run = make_run_dir(tmp_path)
    sas = str(sas_file(tmp_path, container_sas(WRITE_ONLY, container="nothere")))
    good = {"dir": str(run), "account_url": azurite.url, "container": "results", "prefix": "r", "sas_file": sas}
    missing = run_tool("upload_results.py", *upload_args(**{**good, "container": "nothere"}))
    assert missing.returncode == 2
    assert b"HTTP 404 ContainerNotFound: the container nothere does not exist" in missing.stderr
    for change, message in (
        ({"account_url": f"{azurite.url}?sig=x"}, "--account-url must not carry a query string"),
        ({"account_url": "ftp://example"}, "not an http(s) URL"),
        ({"dir": str(tmp_path / "none")}, "is not a directory"),
        ({"sas_file": str(tmp_path / "none.sas")}, "cannot read --sas-file"),
        ({"sas_file": str(run / "output.log")}, "does not hold a SAS token"),
        ({"prefix": "a/../b"}, "expected a blob name prefix"),
        ({"client_id": "abc"}, "--client-id goes with --managed-identity"),
    ):
        result = run_tool("upload_results.py", *upload_args(**{**good, **change}))
        assert result.returncode == 2 and message in result.stderr.decode(), (change, result.stderr)
        assert "Traceback" not in result.stderr.decode()
    no_sas = {k: v for k, v in good.items() if k != "sas_file"}
    for extra, message in (
        (["--managed-identity"], "--managed-identity needs an https --account-url"),
        (["--sas-file", sas, "--managed-identity"], "not allowed with argument"),
        ([], "one of the arguments --sas-file --managed-identity is required"),
    ):
        result = run_tool("upload_results.py", *upload_args(**no_sas), *extra)
        assert result.returncode == 2 and message in result.stderr.decode(), (extra, result.stderr)


def test_an_unreachable_service_is_tried_three_times_then_reported(tmp_path):
    port = free_port()  # nobody listens there
    sas = str(sas_file(tmp_path, "sv=1&sig=abc"))
    given = {"account_url": f"http://127.0.0.1:{port}/{ACCOUNT}", "container": "results", "prefix": "r"}
    started = time.monotonic()
    result = run_tool("upload_results.py", *upload_args(dir=str(make_run_dir(tmp_path)), sas_file=sas, **given))
    assert result.returncode == 3
    assert f"cannot reach http://127.0.0.1:{port} (ConnectionRefusedError" in result.stderr.decode()
    assert "3 tries" in result.stderr.decode()
    assert time.monotonic() - started >= 3  # paused 1 s, then 2 s


class IMDS(http.server.BaseHTTPRequestHandler):
    """The instance metadata service's token endpoint: answers the queued (status, body) replies in
    order and records every request's path and headers."""

    replies: ClassVar[list[tuple[int, dict]]] = []
    requests: ClassVar[list[tuple[str, dict]]] = []

    def do_GET(self) -> None:
        IMDS.requests.append((self.path, dict(self.headers)))
        status, body = IMDS.replies.pop(0)
        reply_json(self, status, body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def imds() -> Iterator[str]:
    IMDS.replies, IMDS.requests = [], []
    with serving(IMDS) as base:
        yield f"{base}/metadata/identity/oauth2/token"


def test_a_managed_identitys_token_comes_from_imds_with_its_client_id_and_a_retry(imds):
    IMDS.replies = [(500, {"error": "busy"}), (200, {"access_token": "tok-123", "expires_in": "3599"})]
    assert upload_results.imds_token("cid-1", token_url=imds) == "tok-123"
    assert len(IMDS.requests) == 2
    path, headers = IMDS.requests[1]
    assert path == (
        "/metadata/identity/oauth2/token?api-version=2018-02-01"
        "&resource=https%3A%2F%2Fstorage.azure.com%2F&client_id=cid-1"
    )
    assert headers["Metadata"] == "true"
    IMDS.replies = [(200, {"access_token": "tok-456"})]
    assert upload_results.imds_token(None, token_url=imds) == "tok-456"
    assert "client_id" not in IMDS.requests[2][0]


def test_an_identity_imds_does_not_know_is_a_clear_error(imds, tmp_path):
    IMDS.replies = [(400, {"error": "invalid_request", "error_description": "Identity not found"})]
    run = make_run_dir(tmp_path)
    args = ["--dir", str(run), "--account-url", "https://127.0.0.1:1/acct", "--container", "results"]
    args += ["--prefix", "r", "--managed-identity", "--client-id", "cid-9"]
    result = run_tool("upload_results.py", *args, env={"IMDS_ENDPOINT": imds})
    assert result.returncode == 3
    assert result.stderr.decode() == (
        "upload_results: error: no token for the managed identity cid-9: IMDS answered HTTP 400: "
        "Identity not found (is the identity assigned to this VM?)\n"
    )
    IMDS.replies = [(200, {"token_type": "Bearer"})]
    with pytest.raises(upload_results.UploadError, match="holds no access_token"):
        upload_results.imds_token("cid-9", token_url=imds)


# --- srun_ssh.py -------------------------------------------------------------------------------
def horovod_ssh_commands() -> dict[str, str]:
    """The ssh command lines horovod 0.28.1 itself builds (its own code, in the training environment):
    the connectivity check, a gloo worker (one quoted word), a task server (several words)."""
    code = """
import json, os, sys
from shlex import quote
from horovod.runner.util.remote import get_remote_command
worker = quote("cd /work > /dev/null 2>&1 ; HOROVOD_RANK=1 HOROVOD_SIZE=2 python -m training.pytorch --steps 2")
print(json.dumps({
    "check": get_remote_command("true", "node-1", port=None, identity_file=None, timeout_s=10),
    "check_port": get_remote_command("true", "node-1", port=2222, identity_file="/k/id", timeout_s=10),
    "worker": get_remote_command(worker, "node-1"),
    "worker_port": get_remote_command(worker, "node-1", port=2222),
    "task": get_remote_command("/py -m horovod.runner.task_fn AAA= BBB= CCC=", "node-1", 2222, "/k/id"),
}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    out = subprocess.run([str(TRAIN_BIN / "python"), "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def test_every_ssh_command_horovodrun_builds_becomes_host_and_command():
    commands = horovod_ssh_commands()
    worker = "cd /work > /dev/null 2>&1 ; HOROVOD_RANK=1 HOROVOD_SIZE=2 python -m training.pytorch --steps 2"
    expected = {
        "check": "true",
        "check_port": "true",
        "worker": worker,
        "worker_port": worker,
        "task": "/py -m horovod.runner.task_fn AAA= BBB= CCC=",
    }
    for name, line in commands.items():
        argv = shlex.split(line)  # horovod runs it through a shell
        assert argv[0] == "ssh"
        assert srun_ssh.parse_ssh_args(argv[1:]) == ("node-1", expected[name]), line


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["-p22", "-oConnectTimeout=5", "node-0", "echo", "a  b"], ("node-0", "echo a  b")),
        (["user@node-0", "-i", "k", "--", "-x", "y"], ("node-0", "-x y")),
        (["--", "node-0", "-p", "22"], ("node-0", "-p 22")),
        (["node-0", "ls", "-p", "1"], ("node-0", "ls -p 1")),  # options end at the command
    ],
)
def test_ssh_arguments_read_as_openssh_reads_them(argv, parsed):
    assert srun_ssh.parse_ssh_args(argv) == parsed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-X", "node-0", "true"], "unknown option -X"),
        (["-L", "80:h:80", "node-0", "true"], "unknown option -L"),
        (["-o"], "option -o needs a value"),
        (["-p", "22"], "no host given"),
        (["node-0"], "no command for node-0"),
        (["node 0", "true"], "is not a node name"),
    ],
)
def test_ssh_arguments_it_cannot_honour_are_refused(argv, message):
    with pytest.raises(srun_ssh.SshUsageError, match=message):
        srun_ssh.parse_ssh_args(argv)


def test_a_worker_becomes_a_one_task_step_on_its_node_with_the_jobs_resources_there():
    assert srun_ssh.srun_argv("42", "node-1", "cd /w ; python x.py") == [
        "srun",
        "--jobid=42",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=node-1",
        "--mem=0",
        "--export=ALL",
        "bash",
        "-c",
        "trap '' USR1; cd /w ; python x.py",  # an eviction's SIGUSR1 is for the ranks
    ]
    # what sbatch --nodes=2 --ntasks-per-node=8 -c 4 --mem=100G --gres=gpu:8 leaves in the batch step
    batch = {
        "SLURM_JOB_ID": "42",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_JOB_NODELIST": "node-[0-1]",
        "PATH": "/run/remote/bin:/usr/bin",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.4",
        "SLURM_NTASKS": "16",
        "SLURM_NPROCS": "16",
        "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_MEM_PER_NODE": "102400",
        "SLURM_GPUS_PER_NODE": "8",
        "SLURM_DISTRIBUTION": "block",
    }
    env = srun_ssh.step_environment(batch)
    assert env == {
        "SLURM_JOB_ID": "42",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_JOB_NODELIST": "node-[0-1]",
        "PATH": "/run/remote/bin:/usr/bin",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.4",
        "SLURM_EXIT_ERROR": "255",  # srun's own failures look like ssh's: 255
    }


def test_outside_a_slurm_job_or_with_an_unknown_option_it_fails_as_ssh_does():
    outside = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    result = subprocess.run(
        [sys.executable, str(REMOTE / "srun_ssh.py"), "-o", "A=b", "node-1", "true"],
        capture_output=True,
        text=True,
        env=outside,
        timeout=30,
    )
    assert result.returncode == 255
    assert result.stderr == (
        "ssh (srun_ssh.py): error: not inside a Slurm job (SLURM_JOB_ID is not set): run it from a batch script\n"
    )
    result = run_tool("srun_ssh.py", "-A", "node-1", "true", env={"SLURM_JOB_ID": "7"})
    assert result.returncode == 255 and result.stderr.decode().startswith("ssh (srun_ssh.py): error: unknown option -A")
    result = run_tool("srun_ssh.py", "--help")
    assert result.returncode == 0 and b"srun --jobid=$SLURM_JOB_ID --overlap" in result.stdout


# --- record_run.py -----------------------------------------------------------------------------
def record_run(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REMOTE / "record_run.py"), "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
    )


def test_each_attempt_adds_its_node_hours_and_the_cost_uses_the_price_launch_recorded(tmp_path):
    job = {"run_id": "r-1", "framework": "pytorch", "gpu_sku": "Standard_ND96isr_H100_v5", "region": "eastus"}
    (tmp_path / "job.json").write_text(json.dumps({**job, "price_per_node_hour_usd": 100.0, "price_source": "t"}))
    now = int(time.time())
    first = record_run(tmp_path, "--nodes", "2", "--attempt", "1", "--started-at", str(now - 1800), "--exit-code", "1")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("1.0") and "estimated $100" in first.stdout  # 2 nodes x 30 minutes
    # a requeued attempt on 4 nodes for 15 minutes: another node-hour, and both attempts are kept
    again = record_run(tmp_path, "--nodes", "4", "--attempt", "2", "--started-at", str(now - 900), "--exit-code", "0")
    assert again.returncode == 0, again.stderr
    record = json.loads((tmp_path / "run.json").read_text())
    assert [a["attempt"] for a in record["attempts"]] == [1, 2] and record["exit_code"] == 0
    assert record["node_hours"] == pytest.approx(2.0, abs=0.01)
    assert record["estimated_cost_usd"] == pytest.approx(200.0, abs=1.0)
    assert (record["gpu_sku"], record["region"], record["price_source"]) == (job["gpu_sku"], "eastus", "t")
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]  # written atomically


@pytest.mark.parametrize(
    ("job", "tres", "share"),
    [
        ({"node_gpus": 8, "gpus_per_node": 1}, "cpu=12,mem=100G,node=1,billing=12,gres/gpu=1", 1 / 8),
        ({"node_gpus": 8, "gpus_per_node": 2}, "cpu=4,node=2,gres/gpu=4", 4 / 8),  # 2 nodes x 2 GPUs
        ({"node_gpus": 8, "gpus_per_node": 1, "exclusive": True}, "cpu=96,node=1,gres/gpu=1", 1),  # holds the node
        ({"node_gpus": 8, "gpus_per_node": 1}, "", 1 / 8),  # squeue unreachable: the request launch quoted
        ({"node_gpus": 8, "gpus_per_node": 3}, "cpu=3,node=1", 3 / 8),  # AllocTRES without GPUs: the request
        ({"node_gpus": 0, "gpus_per_node": 0}, "cpu=24,mem=1G,node=1", 24 / 96),  # a CPU-only node: its CPUs
        ({}, "cpu=1,node=1,gres/gpu=1", 1),  # a job.json from before shares: whole nodes, as then
    ],
)
def test_a_job_is_charged_the_gpus_it_was_allocated_not_its_whole_nodes(tmp_path, job, tres, share):
    """A 1-GPU job on an 8-GPU node costs 1/8 of the node's price for the same time (AllocTRES)."""
    (tmp_path / "job.json").write_text(json.dumps({"run_id": "r-4", "price_per_node_hour_usd": 96.0, **job}))
    nodes = "2" if "node=2" in tres else "1"
    started = str(int(time.time()) - 3600)
    args = ("--nodes", nodes, "--attempt", "1", "--started-at", started, "--exit-code", "0", "--alloc-tres", tres)
    proc = record_run(tmp_path, *args, "--node-cpus", "96")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "run.json").read_text())
    attempt = record["attempts"][0]
    assert record["node_hours"] == pytest.approx(int(nodes), abs=0.01)  # the time its nodes were held
    assert attempt["billed_nodes"] == pytest.approx(share)
    assert record["billed_node_hours"] == pytest.approx(share, abs=0.01)
    assert record["estimated_cost_usd"] == pytest.approx(96.0 * share, abs=0.1)


def test_an_attempt_lost_with_its_node_is_recorded_by_the_next_one(tmp_path):
    """Attempt 1's first node was evicted unseen: its batch script never recorded it. Attempt 2 adds it,
    charged from its start to attempt 2's, from the line job.sh wrote as each attempt started."""
    prices = {"spot": 10.0, "gpu": 100.0}
    (tmp_path / "job.json").write_text(json.dumps({"run_id": "r-3", "prices_per_node_hour_usd": prices}))
    now = int(time.time())
    (tmp_path / "attempts.started").write_text(f"1 {now - 1800} spot\n2 {now - 600} spot\n")
    done = record_run(tmp_path, "--nodes", "2", "--attempt", "2", "--started-at", str(now - 600), "--exit-code", "0",
                      "--partition", "spot")  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "run.json").read_text())
    lost, last = record["attempts"]
    assert (lost["attempt"], lost["lost"], lost["exit_code"], lost["preempted"]) == (1, True, None, False)
    assert (lost["seconds"], lost["partition"]) == (1200, "spot")
    assert lost["estimated_cost_usd"] == pytest.approx(6.667, abs=0.001)  # 2 nodes x 20 min at the Spot price
    assert (last["attempt"], last["exit_code"], "lost" in last) == (2, 0, False)
    assert record["exit_code"] == 0


def test_without_a_price_the_record_has_node_hours_but_no_cost_and_without_a_job_it_refuses(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"run_id": "r-2", "price_per_node_hour_usd": None}))
    started = str(int(time.time()) - 360)
    proc = record_run(tmp_path, "--nodes", "1", "--attempt", "1", "--started-at", started, "--exit-code", "0")
    assert proc.returncode == 0 and "estimated" not in proc.stdout
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["estimated_cost_usd"] is None and record["node_hours"] == pytest.approx(0.1, abs=0.01)
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = record_run(empty, "--nodes", "1", "--attempt", "1", "--started-at", started, "--exit-code", "0")
    assert proc.returncode == 2 and "no job.json" in proc.stderr
