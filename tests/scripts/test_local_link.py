"""`local link-rate` on the session's running cluster: a real transfer between two node namespaces
takes as long as the rate says, and full speed again once it is lifted; inside a node nothing slows."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.errors import OperatorError
from dtrain.local import cluster as local_cluster
from dtrain.local import link as local_link
from dtrain.local.daemons import free_port
from dtrain.local.state import NodeState, load_state

PAYLOAD_BYTES = 1_000_000
SLOW = "16mbit"  # 2 MB/s: the payload takes 0.5 s

RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
connection, _ = server.accept()
started, got = time.monotonic(), 0
while chunk := connection.recv(65536):
    got += len(chunk)
print(got, time.monotonic() - started, flush=True)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    s.sendall(b"x" * int(sys.argv[3]))
"""


def in_namespace(node: NodeState, code: str, *args: object) -> list[str]:
    return ["ip", "netns", "exec", str(node.namespace), sys.executable, "-c", code, *map(str, args)]


def transfer_seconds(sender: NodeState, receiver: NodeState) -> float:
    port = free_port()
    with subprocess.Popen(
        in_namespace(receiver, RECEIVE, receiver.address, port), stdout=subprocess.PIPE, text=True
    ) as rx:
        try:
            assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
            subprocess.run(in_namespace(sender, SEND, receiver.address, port, PAYLOAD_BYTES), check=True, timeout=30)
            got, seconds = rx.stdout.readline().split()
        finally:
            rx.kill()
    assert int(got) == PAYLOAD_BYTES
    return float(seconds)


@pytest.fixture
def nodes(cluster_dir: Path) -> Iterator[list[NodeState]]:
    state = load_state(cluster_dir)
    assert state is not None and state.mode == "netns"
    try:
        yield state.nodes
    finally:  # the session's cluster is everyone's: leave it at full speed
        local_cluster.set_link_rate(cluster_dir, local_link.FULL_SPEED)


def test_link_rate_slows_traffic_between_nodes_until_lifted(cluster_dir: Path, nodes: list[NodeState]) -> None:
    first, second = nodes[:2]
    assert local_cluster.set_link_rate(cluster_dir, SLOW.upper()) == SLOW
    assert local_link.current_rate(str(first.namespace)) == "16Mbit"
    assert local_cluster.status(cluster_dir)["link_rate"] == SLOW
    slowed = transfer_seconds(first, second)
    assert slowed >= 0.8 * PAYLOAD_BYTES * 8 / local_link.rate_bits(SLOW), f"{slowed:.2f} s at {SLOW}"
    assert transfer_seconds(first, first) < slowed / 4  # inside a node: over lo, not the link

    assert local_cluster.set_link_rate(cluster_dir, "full") is None
    assert local_link.current_rate(str(first.namespace)) is None
    assert local_cluster.status(cluster_dir)["link_rate"] == local_link.FULL_SPEED
    assert transfer_seconds(first, second) < slowed / 4


def test_tbf_bucket_scales_with_the_rate() -> None:
    assert local_link.parse_link_rate(" 1.5Gbit ") == "1.5gbit"
    assert local_link.parse_link_rate("FULL") is None
    assert local_link.tbf_arguments("100mbit") == ["tbf", "rate", "100mbit", "burst", "125000", "latency", "50ms"]
    assert local_link.tbf_arguments("1mbit")[4] == "16000"  # never below a few full-size packets


def test_one_nodes_link_slows_only_that_node_and_an_unknown_node_is_refused(
    cluster_dir: Path, nodes: list[NodeState]
) -> None:
    first, second = nodes[:2]
    assert local_cluster.set_link_rate(cluster_dir, SLOW, node=second.hostname) == SLOW
    assert local_link.current_rate(str(second.namespace)) == "16Mbit"
    assert local_link.current_rate(str(first.namespace)) is None
    assert local_cluster.status(cluster_dir)["node_link_rates"] == {second.hostname: SLOW}
    slowed = transfer_seconds(second, first)
    assert transfer_seconds(first, second) < slowed / 4  # what the healthy node sends keeps its speed
    with pytest.raises(OperatorError, match=r"no node 'node-9' in this cluster: its nodes are node-0, node-1"):
        local_cluster.set_link_rate(cluster_dir, SLOW, node="node-9")
    assert local_cluster.set_link_rate(cluster_dir, "full") is None  # every node, its own rate forgotten
    assert local_cluster.status(cluster_dir)["node_link_rates"] == {}
