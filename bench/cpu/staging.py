"""Figure 5 (runs in the operator venv): staging upload to Azurite, ours against a sequential loop.

``python -m bench.cpu.staging --source DIR --rounds N --json OUT`` starts its own Azurite from
``node_modules``, then, per round and in this order, uploads every file under ``DIR`` with

* the baseline: one ``upload_blob`` call per file, one file at a time (what a hand-written
  loop or ``az storage blob upload`` per file does);
* ours: ``dtrain.cli.staging.upload`` (parallel workers, Content-MD5, resumable), as the
  ``stage upload`` command runs it;
* ours with ``--shard-size-mb``: the same command packing files into tar shards first
  (packing is inside the timed window).

Each upload goes to a fresh prefix, so nothing is skipped as already present.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from azure.storage.blob import BlobServiceClient, ContainerClient

from bench.harness.proc import REPO_ROOT, free_port
from dtrain.cluster.description import BlobCredential, BlobLocation
from dtrain.datasets import staging

ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key, published by Microsoft; not a secret.
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "data"
SHARD_MB = 16.0
AZURITE_FLAGS = ("--skipApiVersionCheck", "--silent")  # newest SDK headers accepted; no access log


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (from /proc: the operator venv has no psutil)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def azurite(location: Path) -> Iterator[tuple[str, int]]:
    """Azurite on a free loopback port; yields its connection string and pid, stops it by pid."""
    binary = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run `npm ci` in {REPO_ROOT}")
    port = free_port()
    proc = subprocess.Popen(
        [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(location), *AZURITE_FLAGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    conn = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};BlobEndpoint={endpoint};"
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):  # before any SDK call: its retries back off for seconds
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"Azurite did not start on port {port}")
            time.sleep(0.1)
        BlobServiceClient.from_connection_string(conn).create_container(CONTAINER)
        yield conn, proc.pid
    finally:
        proc.kill()  # SIGTERM makes Azurite drain for seconds; its store is a temporary directory
        proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def data_container(conn: str) -> BlobLocation:
    endpoint = conn.split("BlobEndpoint=")[1].rstrip(";")
    return BlobLocation(
        endpoint=endpoint, container=CONTAINER, credential=BlobCredential(kind="connection_string", secret=conn)
    )


@contextmanager
def timed(server_pid: int, out: dict[str, list[float]], key: str) -> Iterator[None]:
    """Record wall seconds and the CPU seconds of the client (us) and of the server (Azurite):
    the CPU split is the profile that says which side bounds an upload on this machine."""
    wall, client, server = time.perf_counter(), time.process_time(), cpu_seconds(server_pid)
    yield
    out[key].append(time.perf_counter() - wall)
    out[f"{key}_client_cpu"].append(time.process_time() - client)
    out[f"{key}_server_cpu"].append(cpu_seconds(server_pid) - server)


def sequential(client: ContainerClient, source: Path, prefix: str) -> None:
    for name, path in staging.list_files(source):
        with open(path, "rb") as handle:
            client.upload_blob(f"{prefix}/{name}", handle, overwrite=True)


def ours(container: BlobLocation, source: Path, dataset: str, shard_dir: Path | None) -> None:
    summary = staging.upload(
        container,
        container.credential,
        source,
        dataset,
        shard_size_mb=SHARD_MB if shard_dir else None,
        shard_dir=shard_dir,
        show_progress=False,
    )
    if summary.failed or summary.skipped:
        raise RuntimeError(f"upload of {dataset}: {summary.failed} failed, {summary.skipped} skipped")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu.staging", description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    files = staging.list_files(args.source)
    total = sum(path.stat().st_size for _, path in files)
    seconds: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="bench-azurite-") as tmp, azurite(Path(tmp) / "blob") as (conn, pid):
        container = data_container(conn)
        client = ContainerClient.from_connection_string(conn, CONTAINER)
        for r in range(args.rounds):
            with timed(pid, seconds, "sequential"):
                sequential(client, args.source, f"seq-{r}")
            with timed(pid, seconds, "ours"):
                ours(container, args.source, f"ours-{r}", None)
            shards = Path(tmp) / f"shards-{r}"
            with timed(pid, seconds, "ours_sharded"):
                ours(container, args.source, f"sharded-{r}", shards)
            shutil.rmtree(shards)
    args.json.write_text(json.dumps({"files": len(files), "bytes": total, "seconds": seconds}))


if __name__ == "__main__":
    main()
