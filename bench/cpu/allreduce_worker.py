"""Run under ``horovodrun -np 2 --gloo``: allreduce ResNet-50's gradient volume, and the bound.

Per rank, interleaved over ``--rounds``:

* ``fp32``: ``hvd.allreduce`` of 25.6 M float32 (one tensor; the fused buffer of a real step);
* ``fp16``: the same with ``hvd.Compression.fp16`` (cast, allreduce half the bytes, cast back);
* ``link``: the bandwidth bound, both ranks sending ``nbytes`` to each other at once over a
  loopback TCP socket (a 2-rank ring moves exactly that: ``2 (n-1)/n x nbytes`` each way);
* ``memcpy``: one in-memory copy of ``nbytes``, the ceiling under any loopback transfer.

Rank 0 writes the seconds of every round to ``--metrics-json``.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch

from bench.harness.scaling_model import RESNET50_PARAMS

CHUNK = 4 * 2**20


def _exchange(sock: socket.socket, payload: memoryview, sink: memoryview) -> None:
    """Send ``payload`` and receive ``len(sink)`` bytes at the same time (full duplex)."""
    sender = threading.Thread(target=sock.sendall, args=(payload,))
    sender.start()
    got = 0
    while got < len(sink):
        got += sock.recv_into(sink[got : got + CHUNK])
    sender.join()


def _connect(rank: int) -> socket.socket:
    """A TCP connection between rank 0 and rank 1 on loopback (port from rank 0's broadcast)."""
    if rank == 0:
        server = socket.create_server(("127.0.0.1", 0))
        hvd.broadcast_object(server.getsockname()[1], root_rank=0, name="port")
        sock, _ = server.accept()
        server.close()
    else:
        port = hvd.broadcast_object(None, root_rank=0, name="port")
        sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu.allreduce_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=RESNET50_PARAMS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--metrics-json", type=Path, required=True)
    args = parser.parse_args()
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit("run with exactly 2 processes: the link bound is a 2-rank exchange")
    tensor = torch.ones(args.elements, dtype=torch.float32)
    nbytes = tensor.numel() * tensor.element_size()
    payload = memoryview(np.ones(nbytes, np.uint8))
    sink = memoryview(np.empty(nbytes, np.uint8))
    sock = _connect(hvd.rank())

    def allreduce(compression: object) -> None:
        hvd.allreduce(tensor, op=hvd.Average, compression=compression, name="grad")

    ops = {
        "fp32": lambda: allreduce(hvd.Compression.none),
        "fp16": lambda: allreduce(hvd.Compression.fp16),
        "link": lambda: _exchange(sock, payload, sink),
        "memcpy": lambda: np.copyto(np.asarray(sink), np.asarray(payload)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ops}
    for round_ in range(args.rounds + 1):  # round 0 warms up buffers and connections
        for name, op in ops.items():
            hvd.barrier()  # both ranks start together, as in a training step
            start = time.perf_counter()
            op()
            if round_:
                seconds[name].append(time.perf_counter() - start)
    sock.close()
    if hvd.rank() == 0:
        args.metrics_json.write_text(json.dumps({"bytes": nbytes, "seconds": seconds}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
