"""The local cluster's network: a bridge on the host and one network namespace per machine, each
plugged into the bridge with a veth pair (eth0 inside) and given its own /etc/hosts.

Needs root. Every name handed in is the caller's to record before it is created, so that a failed
`up` can remove what it made and nothing else.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from dtrain.errors import ExitCode, OperatorError

ETC_NETNS = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise OperatorError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}", ExitCode.FAILED)
    return proc


def netns_allowed(probe: str) -> bool:
    """Whether network namespaces can be made here (root, iproute2, util-linux); probe: a free name."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        return False
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    sh("ip", "netns", "del", probe, check=False)
    return True


def check_subnet_free(subnet: ipaddress.IPv4Network) -> None:
    """Refuse a range that any interface or route on this machine already uses."""
    out = sh("ip", "-o", "-4", "addr", "show").stdout
    for line in out.splitlines():
        fields = line.split()
        cidr = fields[fields.index("inet") + 1]
        if ipaddress.ip_interface(cidr).network.overlaps(subnet):
            raise OperatorError(
                f"subnet {subnet} is already in use on this machine ({fields[1]} has {cidr}): pass another --subnet"
            )
    for line in sh("ip", "-4", "route", "show").stdout.splitlines():
        dest = line.split()[0]
        if dest != "default" and "/" in dest and ipaddress.ip_network(dest, strict=False).overlaps(subnet):
            raise OperatorError(
                f"subnet {subnet} overlaps the route {line.strip()!r} on this machine: pass another --subnet"
            )


def interface_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def namespace_exists(name: str) -> bool:
    return Path(f"/run/netns/{name}").exists()


def add_bridge(bridge: str, address: str, prefixlen: int) -> None:
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{address}/{prefixlen}", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")


def add_namespace(namespace: str, veth: str, bridge: str, address: str, prefixlen: int) -> None:
    """A namespace with `lo` up and eth0 at address, the other end of its veth (`veth`) on bridge."""
    sh("ip", "netns", "add", namespace)
    peer = f"{veth}p"  # renamed eth0 once inside
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
    sh("ip", "link", "set", peer, "netns", namespace)
    sh("ip", "link", "set", veth, "master", bridge)
    sh("ip", "link", "set", veth, "up")
    inside = ("ip", "netns", "exec", namespace)
    sh(*inside, "ip", "link", "set", peer, "name", "eth0")
    sh(*inside, "ip", "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
    sh(*inside, "ip", "link", "set", "eth0", "up")
    sh(*inside, "ip", "link", "set", "lo", "up")


def hosts_file_text(hosts: Sequence[tuple[str, str]]) -> str:
    """/etc/hosts listing localhost and every (address, name)."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    return "\n".join([*lines, *(f"{address}\t{name}" for address, name in hosts)]) + "\n"


def etc_dir(namespace: str) -> Path:
    return ETC_NETNS / namespace


def namespace_pids(namespace: str) -> list[int]:
    """Every process inside the network namespace (host pids)."""
    if not namespace_exists(namespace):
        return []
    return [int(p) for p in sh("ip", "netns", "pids", namespace, check=False).stdout.split() if p.isdigit()]


def remove(namespaces: Sequence[str], links: Sequence[str], etc_dirs: Sequence[str]) -> None:
    """Delete namespaces, links (veths, then the bridge) and /etc/netns directories; absent ones are skipped."""
    for namespace in namespaces:
        if namespace_exists(namespace):
            sh("ip", "netns", "del", namespace, check=False)
    for link in links:
        if interface_exists(link):
            sh("ip", "link", "del", link, check=False)
    for etc in etc_dirs:
        shutil.rmtree(etc, ignore_errors=True)
    if etc_dirs:
        with contextlib.suppress(OSError):  # only when empty: other clusters may be using it
            ETC_NETNS.rmdir()
