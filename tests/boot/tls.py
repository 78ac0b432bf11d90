"""A throwaway certificate authority for the boot test (runs on the host): made per test run with
openssl, so no private key is ever cached or committed. The VMs trust its certificate (the seed's
vendor data hands it to cloud-init's ca_certs), and the emulated Key Vault and ARM serve a
certificate it signed for Azure's own host names."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The names the VMs reach over HTTPS, as Azure spells them.
SERVER_NAMES = (
    "*.vault.azure.net",
    "management.azure.com",
    "*.blob.core.windows.net",
    "*.azurecr.io",
    "packages.microsoft.com",
)


@dataclass(frozen=True)
class TestCa:
    certificate: str  # the CA's certificate (PEM), which the VMs trust
    server: ssl.SSLContext  # for the HTTPS endpoints
    directory: Path  # ca.pem, server.pem, server.key: for servers that read files (Azurite)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(work: Path, addresses: tuple[str, ...] = ()) -> TestCa:
    """addresses: IP addresses the server certificate names too (the host reaches a server by its address)."""
    work.mkdir(parents=True, exist_ok=True)
    days = "2"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", days, "-subj", "/CN=dtrain boot test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
             cwd=work)  # fmt: skip
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=azure endpoints (boot test)",
             cwd=work)  # fmt: skip
    names = [f"DNS:{name}" for name in SERVER_NAMES] + [f"IP:{address}" for address in addresses]
    (work / "server.ext").write_text("subjectAltName=" + ",".join(names) + "\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", days, "-extfile", "server.ext", cwd=work)  # fmt: skip
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(work / "server.pem", work / "server.key")
    return TestCa((work / "ca.pem").read_text(), server, work)
