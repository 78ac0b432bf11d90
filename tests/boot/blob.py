"""The stack's results account for the boot test (runs on the host, in the hub namespace): Azurite over
HTTPS at the account's own name (`<account>.blob.core.windows.net`, which Azurite reads as a
production-style URL), with the test CA's certificate, taking the bearer tokens that the emulated IMDS
issues for Azure Storage (`--oauth basic`: Azurite checks a token's audience, issuer and lifetime, not
its signature, and grants no roles, so the results container's role scoping is not what this shows).
A job's upload reaches it the way it reaches Azure: the node's managed identity, a token from IMDS,
HTTPS to the account's name.
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from azure.storage.blob import BlobServiceClient

from tests.boot.vms import Namespace

AZURITE = Path(__file__).resolve().parents[2] / "node_modules" / ".bin" / "azurite-blob"
READY_TIMEOUT_S = 120


class ResultsAccount:
    """Azurite serving one account at address:443; the host reads it with the account key."""

    def __init__(self, account: str, address: str, hub: Namespace) -> None:
        self.account, self.address, self.hub = account, address, hub
        self.key = base64.b64encode(os.urandom(32)).decode()

    @contextmanager
    def serving(self, work: Path, certificate: Path, key: Path, ca: Path) -> Iterator[None]:
        self.ca = ca
        argv = [str(AZURITE), "--blobHost", self.address, "--blobPort", "443", "--cert", str(certificate),
                "--key", str(key), "--oauth", "basic", "--location", str(work), "--skipApiVersionCheck",
                "--loose", "--silent"]  # fmt: skip
        env = {**os.environ, "AZURITE_ACCOUNTS": f"{self.account}:{self.key}"}
        log = (work.parent / "azurite.log").open("ab")
        process = self.hub.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_until_it_answers(process)
            yield
        finally:
            process.terminate()
            process.wait(30)
            log.close()

    def _wait_until_it_answers(self, process: subprocess.Popen[bytes]) -> None:
        probe = ["curl", "-sS", "-o", "/dev/null", "--cacert", str(self.ca), "--max-time", "2", "--resolve",
                 f"{self.account}.blob.core.windows.net:443:{self.address}",
                 f"https://{self.account}.blob.core.windows.net/"]  # fmt: skip
        for _ in range(READY_TIMEOUT_S):
            if process.poll() is not None:
                raise RuntimeError(f"Azurite ended at start ({process.returncode})")
            if self.hub.run(probe, check=False).returncode == 0:
                return
            subprocess.run(["sleep", "1"], check=True)
        raise RuntimeError(f"Azurite did not answer at {self.address}:443 within {READY_TIMEOUT_S} s")

    def client(self) -> BlobServiceClient:
        """The account, path-style at its address (the certificate names it too): call within the hub
        namespace (Namespace.entered)."""
        return BlobServiceClient(
            f"https://{self.address}/{self.account}",
            credential={"account_name": self.account, "account_key": self.key},
            connection_verify=str(self.ca),
        )
