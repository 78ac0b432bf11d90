"""A real apt against stand-in package repositories: what a host's setup program would install, resolved.

`Apt` keeps a whole apt configuration (sources, preferences, state, cache) in a temporary directory
and runs `apt-get` with it (APT_CONFIG), never this machine's. The repositories are small package
indexes served by a local HTTP server; apt reaches them through Acquire::http::Proxy, so that each
keeps its real host name, on which apt's `origin` pins match. (The proxy sees only plain HTTP: an
https:// source is replayed as http:// on the same host, and with [trusted=yes] for want of the
real signing keys.)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

from tests.local_http import serving

# A date in the past: apt refuses a Release file dated in the future.
RELEASE_DATE = "Thu, 01 Jan 2026 00:00:00 UTC"


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    depends: str = ""
    conflicts: str = ""

    def stanza(self) -> str:
        lines = [f"Package: {self.name}", f"Version: {self.version}", "Architecture: amd64"]
        lines += [f"Depends: {self.depends}"] if self.depends else []
        lines += [f"Conflicts: {self.conflicts}"] if self.conflicts else []
        lines += [f"Filename: pool/{self.name}_{self.version}_amd64.deb", "Size: 1", f"Description: {self.name}"]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Repository:
    """One suite of a Debian repository at http://<host><path>, component main."""

    host: str
    path: str  # e.g. /ubuntu/, ending in '/'
    suite: str
    packages: Sequence[Package]

    def files(self) -> dict[tuple[str, str], bytes]:
        index = "\n".join(package.stanza() for package in self.packages).encode()
        digest = hashlib.sha256(index).hexdigest()
        release = (
            f"Suite: {self.suite}\nCodename: {self.suite}\nDate: {RELEASE_DATE}\nArchitectures: amd64\n"
            f"Components: main\nSHA256:\n {digest} {len(index)} main/binary-amd64/Packages\n"
        ).encode()
        dists = f"{self.path}dists/{self.suite}/"
        return {(self.host, f"{dists}Release"): release, (self.host, f"{dists}main/binary-amd64/Packages"): index}


@contextmanager
def mirror(repositories: Sequence[Repository]) -> Iterator[str]:
    """An HTTP proxy that answers for the repositories' hosts; yields its URL."""
    files: dict[tuple[str, str], bytes] = {}
    for repository in repositories:
        files.update(repository.files())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)  # a proxy's request names the whole URL
            body = files.get((url.hostname or "", url.path))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as endpoint:
        yield endpoint


def replayable(line: str) -> str:
    """An apt source line as the stand-in serves it: plain HTTP on the same host, trusted."""
    line = line.replace("https://", "http://")
    return (
        line.replace("deb [", "deb [trusted=yes ", 1)
        if "deb [" in line
        else line.replace("deb ", "deb [trusted=yes] ", 1)
    )


@dataclass
class Apt:
    root: Path
    proxy: str
    etc_files: dict[str, str] = field(default_factory=dict)  # /etc/apt/... path -> content

    def write(self) -> None:
        for directory in ("etc/apt/sources.list.d", "etc/apt/preferences.d", "etc/apt/apt.conf.d",
                          "var/lib/apt/lists/partial", "var/cache/apt/archives/partial", "var/lib/dpkg",
                          "var/log/apt"):  # fmt: skip
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        (self.root / "var/lib/dpkg/status").touch()
        for path, content in self.etc_files.items():
            target = self.root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            text = content
            if "/sources.list" in path:
                text = "".join(replayable(line) + "\n" for line in content.splitlines() if line.strip())
            target.write_text(text)
        (self.root / "apt.conf").write_text(
            f'Dir "{self.root}/";\n'
            f'Dir::State::status "{self.root}/var/lib/dpkg/status";\n'
            f'Acquire::http::Proxy "{self.proxy}";\n'
            'Acquire::Languages "none";\nAPT::Architecture "amd64";\nAPT::Architectures { "amd64"; };\n'
            'APT::Sandbox::User "root";\nDebug::NoLocking "true";\n'
        )

    def run(self, *argv: str, tool: str = "apt-get") -> subprocess.CompletedProcess[str]:
        env: Mapping[str, str] = {**os.environ, "APT_CONFIG": str(self.root / "apt.conf"), "LC_ALL": "C"}
        return subprocess.run([tool, *argv], env=env, capture_output=True, text=True, timeout=120)

    def install(self, packages: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """`apt-get update`, then the install of the setup programs' packages step, simulated."""
        self.write()
        update = self.run("update")
        assert update.returncode == 0 and "Err:" not in update.stdout, update.stdout + update.stderr
        return self.run("--simulate", "--yes", "install", *packages)


def installed(simulation: str) -> dict[str, str]:
    """package -> version from `apt-get --simulate install` output ("Inst name (version ...)")."""
    found = {}
    for line in simulation.splitlines():
        if line.startswith("Inst "):
            name, version = line.split()[1], line.split("(", 1)[1].split()[0]
            found[name] = version
    return found
