"""The speed of the local cluster's links between nodes, slowed on demand with `tc`.

Each node's eth0 (the namespace's end of its veth pair) gets a token-bucket filter (`tbf`) as its
root queueing discipline: everything a node sends, to another node or to the host, leaves at most
at RATE, and each node receives at most RATE from every other, as over a real full-duplex link.
Traffic between the processes of one node stays on that node (the kernel routes a namespace's own
addresses over its `lo`), so it keeps its full speed, as inside a real node.

`tbf`, not `netem`: netem's rate needs the sch_netem module, which not every kernel has (this
machine's has not); tbf is in every distribution kernel. The qdisc lives on the veth, so `down`,
which deletes the veths and namespaces, removes it with them.
"""

from __future__ import annotations

import re

from dtrain.checks import require_tool
from dtrain.errors import OperatorError
from dtrain.local.network import sh

FULL_SPEED = "full"
_RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)")
_UNIT_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
MIN_BITS, MAX_BITS = 64e3, 100e9
LATENCY_MS = 50  # longest a packet waits in the bucket's queue before it is dropped (TCP backs off)


def parse_link_rate(text: str) -> str | None:
    """`100mbit`, `1.5gbit`, `512kbit` as tc spells them, or None for `full` (no limit)."""
    rate = text.strip().lower()
    if rate == FULL_SPEED:
        return None
    match = _RATE.fullmatch(rate)
    if match is None:
        raise OperatorError(f"invalid link rate {text!r}: expected a rate such as 100mbit, 1gbit or 512kbit, or full")
    if not MIN_BITS <= rate_bits(rate) <= MAX_BITS:
        raise OperatorError(f"link rate {text} is out of range: from 64kbit to 100gbit")
    return rate


def require_tc() -> None:
    require_tool("tc", "apt-get install iproute2 (tools/setup_system.sh)")


def rate_bits(rate: str) -> float:
    """Bits per second of a rate that :func:`parse_link_rate` accepted."""
    match = _RATE.fullmatch(rate)
    assert match is not None
    return float(match.group(1)) * _UNIT_BITS[match.group(2)]


def tbf_arguments(rate: str) -> list[str]:
    """The filter's parameters. The bucket holds 10 ms at RATE (at least 16 KB, so that a
    full-size packet and the kernel's timer granularity never starve it)."""
    burst_bytes = max(int(rate_bits(rate) / 8 / 100), 16_000)
    return ["tbf", "rate", rate, "burst", str(burst_bytes), "latency", f"{LATENCY_MS}ms"]


def set_rate(namespace: str, rate: str | None) -> None:
    """Limit what the node in ``namespace`` sends over its eth0 to ``rate``; None: full speed."""
    inside = ("ip", "netns", "exec", namespace, "tc", "qdisc")
    if rate is None:
        if current_rate(namespace) is not None:
            sh(*inside, "del", "dev", "eth0", "root")
        return
    proc = sh(*inside, "replace", "dev", "eth0", "root", *tbf_arguments(rate), check=False)
    if proc.returncode != 0:
        raise OperatorError(
            f"could not slow {namespace}'s link to {rate} with tc tbf: {(proc.stderr or proc.stdout).strip()} "
            "(needs iproute2's tc and the kernel's sch_tbf)"
        )


def current_rate(namespace: str) -> str | None:
    """The rate tc reports for the namespace's eth0, as tc prints it (e.g. `100Mbit`), or None."""
    out = sh("ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", "eth0", "root", check=False).stdout
    match = re.search(r"\btbf\b.*?\brate (\S+)", out)
    return match.group(1) if match else None
