#!/usr/bin/env python3
"""node-gate: measure every node of a multi-node job before it trains, and name the ones to leave out.

Unlike its neighbours this tool needs torch: the batch script (job.sh) runs it with the training
environment's python (or in the job's image), once per node, as one job step, before anything else
(dtrain/jobs/node_gate.py renders the lines). Each node measures three figures:

  node   its own: on GPU nodes an NCCL all-reduce across all its GPUs from this one process
         (torch.cuda.nccl), bus bandwidth in GB/s; on CPU nodes one core's float32 matrix product, GFLOP/s;
  link   what it sends to the next node of a ring, measured by the receiver (a sender's own clock stops
         when its data is in the socket buffer), in GB/s, one transfer at a time; the ring runs both
         ways and the node keeps its better direction, so that a node whose *receiving* side is slow
         does not blame its neighbour (with two nodes there is one pair, and either may be at fault);
  job    an all-reduce across exactly the job's nodes (one process each), bus bandwidth in GB/s.

A node fails when its node or link figure is under the threshold (infra/health_thresholds.py). Every
node failing the link figure at once says more about the fabric or the threshold than about a node:
then none is left out for it, and the report says so. The job figure is reported, and fails the gate
only together with the nodes whose link explains it.

Output: each node writes DIR/<node> (key=value lines: node, ok, the figures, reason), which the nodes'
Epilog reads to drain a failed node with its figure once the job has been requeued
(dtrain/remote/slurm/slurm-epilog.sh); the first node writes DIR/summary.json (the attempt's record in
run.json) and prints one line per node.

Exit status: 0 every node passed; 3 a node failed (job.sh requeues the job without it); 1 the gate could
not measure (job.sh goes on without it, and says so).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

GATE_FAILED = 3
PREFIX = "[gate] "  # every line this prints, as the job log's other sources mark theirs
INIT_TIMEOUT_S = 60  # every node's process must join within this: a node that cannot is for Slurm to find
MATMUL_SIZE = 256
MATMUL_SECONDS = 0.3  # how long the CPU figure's products run
TRANSFER_TRIES = 2  # each node's link: the best of this many transfers each way


def node_rank(nodes: list[str]) -> int:
    """This process's node index: Slurm's SLURM_NODEID, else this host's place in the job's node list."""
    if (node_id := os.environ.get("SLURM_NODEID", "")).isdigit():
        return int(node_id)
    return nodes.index(socket.gethostname().split(".")[0])


def bus_bandwidth_gbs(size_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: the algorithm's bytes times 2(n-1)/n, over the time."""
    return size_bytes * 2 * (ranks - 1) / ranks / max(seconds, 1e-9) / 1e9


def matmul_gflops(torch) -> float:
    """One core's float32 matrix product rate over MATMUL_SECONDS."""
    torch.set_num_threads(1)
    a = torch.rand(MATMUL_SIZE, MATMUL_SIZE)
    b = torch.rand(MATMUL_SIZE, MATMUL_SIZE)
    torch.mm(a, b)  # warm-up
    products, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < MATMUL_SECONDS:
        torch.mm(a, b)
        products += 1
    return products * 2 * MATMUL_SIZE**3 / elapsed / 1e9


def node_allreduce_gbs(torch, message_bytes: int) -> float:
    """Bus bandwidth of an NCCL all-reduce across every GPU of this node, from this one process."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return float("inf")  # nothing to reduce across: no NVLink figure to hold against a threshold
    tensors = [torch.ones(message_bytes // 4, device=f"cuda:{i}") for i in range(gpus)]
    torch.cuda.nccl.all_reduce(tensors)  # warm-up: the communicators are made here
    for i in range(gpus):
        torch.cuda.synchronize(i)
    started = time.perf_counter()
    torch.cuda.nccl.all_reduce(tensors)
    for i in range(gpus):
        torch.cuda.synchronize(i)
    return bus_bandwidth_gbs(message_bytes, time.perf_counter() - started, gpus)


def timed(torch, device, work) -> float:
    """Seconds that ``work`` takes on every rank, from a barrier (and the device's queue drained)."""
    torch.distributed.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def link_rates_gbs(torch, device, message, rank: int, world: int) -> dict[int, float]:
    """GB/s of what each node sends to the next node of the ring and to the one before it, as the receiver
    measures it; one transfer at a time, so that no node's own sending slows another's (the receiver's
    acknowledgements would queue behind its data on a slow link), and the best of TRANSFER_TRIES, so that
    a process that waited for a core on a loaded node does not pass for a slow link. Returns
    {sender: its better direction's rate}."""
    dist = torch.distributed
    incoming = torch.empty_like(message)
    size = message.numel() * message.element_size()
    received: dict[int, float] = {}
    steps = (1,) if world == 2 else (1, -1)  # two nodes: one pair, both ways round the ring
    for sender in range(world):
        for receiver in ((sender + step) % world for step in steps):
            for _ in range(TRANSFER_TRIES):
                if rank == sender:
                    timed(torch, device, functools.partial(dist.send, message, receiver))
                elif rank == receiver:
                    seconds = timed(torch, device, functools.partial(dist.recv, incoming, sender))
                    received[sender] = max(received.get(sender, 0.0), size / seconds / 1e9)
                else:
                    dist.barrier()
    return received


def verdict(figures: list[dict], node_min: float, link_min: float) -> tuple[list[dict], str]:
    """Each node's figures with ok and reason set; and a note when the link failures were not held against nodes."""
    every_link_failed = all(f["link_gbs"] < link_min for f in figures)
    note = ""
    if every_link_failed and len(figures) > 1:
        note = f"every node sent under {link_min:g} GB/s: the fabric or the threshold, not a node; none left out for it"
    for f in figures:
        failed, reasons = [], []
        if f["node_value"] < node_min:
            failed.append("node")
            reasons.append(f"{f['node_figure']} {f['node_value']:.3g} {f['node_unit']} < {node_min:g}")
        if f["link_gbs"] < link_min and not every_link_failed:
            failed.append("link")
            reasons.append(f"link {f['link_gbs']:.3g} GB/s < {link_min:g}")
        f |= {"ok": not failed, "failed": ",".join(failed), "reason": "; ".join(reasons)}
        f |= {"node_min": node_min, "link_min": link_min}
    return figures, note


def write_node_file(out: Path, figures: dict) -> None:
    """DIR/<node>, atomically: the Epilog (root) reads it, and must never see half of one."""
    keys = ("node", "ok", "failed", "node_figure", "node_value", "node_unit", "node_min", "link_gbs", "link_min")
    keys += ("job_allreduce_gbs", "reason")
    lines = [f"{key}={int(figures[key]) if key == 'ok' else figures[key]}" for key in keys]
    tmp = out / f".{figures['node']}.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out / figures["node"])


def measure(args: argparse.Namespace, nodes: list[str]) -> int:
    # c10d warns on every connection it cannot name (nodes known by address only): noise in the job's log
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch  # the training environment's: imported here so that --help works anywhere
    import torch.distributed as dist

    rank, world = node_rank(nodes), len(nodes)
    gpu = args.node_figure == "allreduce" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://{nodes[0]}:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=INIT_TIMEOUT_S),
    )
    started = time.perf_counter()
    message_bytes = args.message_mib * 2**20
    if gpu:
        node_value, unit = node_allreduce_gbs(torch, message_bytes), "GB/s"
    else:
        node_value, unit = matmul_gflops(torch), "GFLOP/s"
    message = torch.ones(message_bytes // 4, device=device)
    dist.all_reduce(torch.ones(1, device=device))  # warm-up: every pair's connection is made here
    received = link_rates_gbs(torch, device, message, rank, world)
    job_gbs = bus_bandwidth_gbs(message_bytes, timed(torch, device, lambda: dist.all_reduce(message)), world)
    gathered: list = [None] * world
    objects = dist.new_group(backend="gloo") if gpu else None  # all_gather_object over NCCL needs CUDA tensors
    dist.all_gather_object(gathered, {"rank": rank, "received": received, "node_value": node_value}, group=objects)
    # each node's link: the better of what its two neighbours received from it
    link = {i: 0.0 for i in range(world)}
    for entry in gathered:
        for sender, rate in entry["received"].items():
            link[sender] = max(link[sender], rate)
    figures = [
        {
            "node": nodes[e["rank"]],
            "node_figure": args.node_figure,
            "node_value": round(e["node_value"], 4),
            "node_unit": unit,
            "link_gbs": round(link[e["rank"]], 4),
            "job_allreduce_gbs": round(job_gbs, 4),
        }
        for e in sorted(gathered, key=lambda e: e["rank"])
    ]
    figures, note = verdict(figures, args.node_min, args.link_min)
    write_node_file(args.out, figures[rank])
    seconds = time.perf_counter() - started
    dist.barrier(group=objects)
    dist.destroy_process_group()
    failed = [f for f in figures if not f["ok"]]
    if rank == 0:
        report(args, figures, note, job_gbs, seconds)
    return GATE_FAILED if failed else 0


def report(args: argparse.Namespace, figures: list[dict], note: str, job_gbs: float, seconds: float) -> None:
    job_low = job_gbs < args.job_min
    summary = {
        "attempt": args.attempt,
        "seconds": round(seconds, 2),
        "job_allreduce_gbs": round(job_gbs, 4),
        "thresholds": {"node": args.node_min, "link_gbs": args.link_min, "job_allreduce_gbs": args.job_min},
        "nodes": figures,
        "excluded": [{"node": f["node"], "reason": f["reason"]} for f in figures if not f["ok"]],
        "note": note,
    }
    tmp = args.out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(args.out / "summary.json")
    low = f" < {args.job_min:g}" if job_low else ""
    print(f"{PREFIX}all-reduce across {len(figures)} nodes: {job_gbs:.3g} GB/s bus bandwidth{low} ({seconds:.1f} s)")
    for f in figures:
        state = "ok" if f["ok"] else f"left out: {f['reason']}"
        own = f"{f['node_figure']} {f['node_value']:.3g} {f['node_unit']}"
        print(f"{PREFIX}{f['node']}: {own}, link {f['link_gbs']:.3g} GB/s: {state}")
    if note:
        print(f"{PREFIX}{note}")
    if job_low and all(f["ok"] for f in figures):
        print(f"{PREFIX}the all-reduce is under its threshold but no node's own figures say which: the job goes on")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the attempt's gate directory (in the run directory)")
    parser.add_argument("--nodes-file", type=Path, required=True, help="the job's nodes, one per line, in rank order")
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the first node's port for the rendezvous")
    parser.add_argument("--node-figure", choices=("allreduce", "matmul"), required=True)
    parser.add_argument("--node-min", type=float, required=True)
    parser.add_argument("--link-min", type=float, required=True, help="GB/s")
    parser.add_argument("--job-min", type=float, required=True, help="GB/s of all-reduce bus bandwidth")
    parser.add_argument("--message-mib", type=int, required=True)
    args = parser.parse_args(argv)
    nodes = args.nodes_file.read_text().split()
    try:
        return measure(args, nodes)
    except Exception as exc:
        print(f"{PREFIX}could not measure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
