"""Starting the measured processes: plain Python, horovodrun and torchrun, with pinned threads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_BIN = Path(sys.executable).parent
TIMEOUT_S = 300
STOP_GRACE_S = 15  # what a stopped process gets to end its own children (torchrun's workers)


class BenchError(RuntimeError):
    """A measured process failed; the message carries the command and the tail of its output."""


def thread_env(threads: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment with every thread pool pinned, so that runs compare like with like."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
        env[name] = str(threads)
    env["TF_NUM_INTEROP_THREADS"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], env: Mapping[str, str], timeout: float = TIMEOUT_S) -> str:
    """``cmd``'s standard output; :class:`BenchError` if it fails or runs past ``timeout`` seconds."""
    with subprocess.Popen(
        list(cmd), cwd=REPO_ROOT, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(child)
            raise BenchError(f"ran past its limit of {timeout:.0f} s: {' '.join(cmd)}") from None
        except BaseException:
            stop(child)
            raise
    if child.returncode != 0:
        tail = (stdout + stderr)[-3000:]
        raise BenchError(f"{' '.join(cmd)} exited {child.returncode}:\n{tail}")
    return stdout


def stop(child: subprocess.Popen[str]) -> None:
    """End ``child`` the way that lets torchrun end its workers: they run in sessions of their own, so
    only torchrun can reach them, and it does on SIGTERM. SIGKILL after ``STOP_GRACE_S``."""
    child.terminate()
    try:
        child.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher(kind: str, np: int) -> list[str]:
    """The command that starts ``np`` local workers of ``-m module``: horovodrun (gloo), torchrun,
    or a plain interpreter; the module and its arguments follow."""
    if kind == "horovod":
        return [str(TRAIN_BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, "-m"]
    if kind == "ddp":
        # torchrun's module: the console script may not sit beside this interpreter (a system Python)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={np}", "-m"]
    if kind == "plain" and np == 1:
        return [sys.executable, "-m"]
    raise ValueError(f"cannot launch {np} worker(s) with {kind!r}")


def run_json(
    kind: str, np: int, module: str, args: Sequence[str], threads: int, *, timeout: float = TIMEOUT_S, **env: str
) -> dict[str, Any]:
    """Run ``module`` on ``np`` workers; it writes its result to ``--metrics-json``, we read it back."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = Path(tmp) / "metrics.json"
        cmd = [*launcher(kind, np), module, *args, "--metrics-json", str(out)]
        run(cmd, thread_env(threads, env), timeout)
        if not out.is_file():
            raise BenchError(f"{' '.join(cmd)} wrote no metrics to {out}")
        return json.loads(out.read_text())


def exit_worker() -> NoReturn:
    """End a measured worker once its result is written, without torch's destructors: freeing a
    gloo process group (DDP's reducer holds one) while its worker thread still releases finished
    work deadlocks on the GIL (seen hanging in ~ProcessGroupGloo). training/run/job.py exits this way too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()
