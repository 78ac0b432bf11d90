"""Which peer stopped answering: every rank answers pings on a TCP port of its own.

A collective that times out fails on the healthy ranks, and its error names no culprit (gloo
reports a timeout or a peer's socket address). So every rank runs a tiny server that answers
every connection, and the first collective of a job shares every rank's host and port. When a
collective fails, the rank that noticed pings all peers: one that is frozen (SIGSTOP, a hung
node) or cut off by the network gives no reply, one that exited refuses the connection, and the
error names it and its host instead of the rank that noticed.

The server is a daemon thread that needs the GIL only for a moment per ping; framework calls
that wait on the network release it, so a rank blocked in a collective still answers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from training.world.distributed import Dist

PROBE_TIMEOUT_SECONDS = 5.0
# Where the launcher's rendezvous lives: the address this host uses to reach it is one its peers can reach.
RENDEZVOUS_ADDRESS_VARIABLES = ("MASTER_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR")


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str  # the host's name, for messages
    address: str  # where its ping server listens
    port: int

    def __str__(self) -> str:
        return f"rank {self.rank} on host {self.host}"


class Liveness:
    """This rank's ping server, and every rank's :class:`Peer` (a collective: all ranks create one).

    Created right after the backend starts: its allgather is the job's first collective.
    """

    def __init__(self, dist: Dist, env: Mapping[str, str] = os.environ) -> None:
        server = _serve() if dist.size > 1 else None
        me = Peer(dist.rank, socket.gethostname(), _reachable_address(env), server.getsockname()[1] if server else 0)
        self.peers: list[Peer] = dist.allgather_object(me)
        self.me = self.peers[dist.rank]

    def troubled_peers(self, timeout: float = PROBE_TIMEOUT_SECONDS, waited: float | None = None) -> dict[Peer, str]:
        """The other ranks that do not answer within ``timeout``, each with what is wrong with it.
        ``waited``: how long the failed collective had waited for them (the peer timeout), if known."""
        others = [peer for peer in self.peers if peer != self.me]
        if not others:
            return {}
        with ThreadPoolExecutor(max_workers=min(len(others), 64)) as pool:
            problems = pool.map(lambda peer: _ping(peer, timeout, waited), others)
            return {peer: problem for peer, problem in zip(others, problems, strict=True) if problem}


def _serve() -> socket.socket:
    server = socket.create_server(("", 0), family=socket.AF_INET, backlog=128)

    def answer() -> None:
        while True:
            conn, _ = server.accept()
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"alive\n")

    threading.Thread(target=answer, name="liveness", daemon=True).start()
    return server


def _ping(peer: Peer, timeout: float, waited: float | None) -> str | None:
    """None if ``peer`` replies within ``timeout``, else what is wrong with it."""
    try:
        with socket.create_connection((peer.address, peer.port), timeout=timeout) as conn:
            conn.recv(16)
    except TimeoutError:
        # A stopped process still completes TCP handshakes (the kernel does), but never replies.
        silent = f"no reply within the {waited:g} s peer timeout, nor to a ping within" if waited else "no reply within"
        return f"stopped answering ({silent} {timeout:g} s)"
    except ConnectionError:
        return "has exited"
    except OSError as exc:
        return f"is unreachable ({(exc.strerror or str(exc)).lower()})"
    return None


def _reachable_address(env: Mapping[str, str]) -> str:
    """The local address of the route to the launcher's rendezvous (no packet is sent)."""
    target = next((env[name] for name in RENDEZVOUS_ADDRESS_VARIABLES if env.get(name)), None)
    if target is None:
        return socket.gethostname()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()
