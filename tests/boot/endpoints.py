"""Azure's endpoints for the boot test's VMs, as real servers on the test's bridge (runs on the host).

- IMDS at 169.254.169.254:80: the local cluster's metadata server (dtrain/local/metadata.py: Scheduled
  Events, the VM's name), plus managed-identity tokens, the VM told apart by its address.
- Key Vault and Azure Resource Manager on one HTTPS server at 443, told apart by the Host header;
  the VMs resolve `<vault>.vault.azure.net` and `management.azure.com` to it (/etc/hosts, from the
  seed's vendor data) and trust its certificate through the test CA (tests/boot/tls.py).
  Key Vault answers a secret read with a token that IMDS issued for Key Vault, or 403, as Azure does
  before a role assignment has propagated (`forbid`). The registry exchanges an ARM token for a
  refresh token and accepts it as `docker login`'s password (acr-login.sh's path). ARM takes the
  scale-set start and deallocate calls of the power program (dtrain/remote/slurm/slurm_power.py)
  and hands them to the test's hosts.
- Microsoft's Slurm repository at its own URL on the same server (its files from a directory:
  tests/boot/seed.py makes it), out of service for a host's first seconds when the test asks
  (`take_repository_down`), as a transient failure of packages.microsoft.com would be.
"""

from __future__ import annotations

import base64
import json
import math
import mimetypes
import re
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dtrain.local.metadata import NAME_PATH, MetadataHandler, MetadataServer
from infra.cloud_init.slurm_packages import SLURM_REPOSITORY_HOST, SLURM_REPOSITORY_URL

TOKEN_PATH = "/metadata/identity/oauth2/token"
VAULT_RESOURCE = "https://vault.azure.net"
STORAGE_RESOURCE = "https://storage.azure.com"
TENANT_ID = "00000000-0000-0000-0000-0000000000bb"
ARM_HOST = "management.azure.com"
ARM_RESOURCE = f"https://{ARM_HOST}/"
ACR_TOKEN_USER = "00000000-0000-0000-0000-000000000000"  # the user name ACR's token login takes
_SECRET = re.compile(r"/secrets/([A-Za-z0-9-]+)/?")
_SCALE_SET_CALL = re.compile(r"(?P<scale_set>/subscriptions/.+)/(?P<action>start|deallocate)")
_INSTANCE_VIEW = re.compile(r"(?P<scale_set>/subscriptions/.+)/virtualMachines/(?P<id>\d+)/instanceView")


@dataclass
class Azure:
    """What the emulated Azure knows: the VMs by address, the tokens it issued, the vault's secrets,
    and what a scale set's start and deallocate do (the test's VM control)."""

    names: dict[str, str]  # VM address -> its name, as IMDS reports it
    secrets: dict[str, str]  # Key Vault secret name -> value
    scale_set_id: str
    instances: list[str]  # the scale set's instance ids
    power: Callable[[str, list[str]], None]  # ("start" | "deallocate", instance ids)
    tokens: dict[str, tuple[str, str]] = field(default_factory=dict)  # token -> (resource, client id)
    forbidden_for: dict[str, float] = field(default_factory=dict)  # VM address -> seconds of 403 from its first read
    first_read: dict[str, float] = field(default_factory=dict)  # VM address -> when it first read a secret
    calls: list[str] = field(default_factory=list)  # "start 0,1", "deallocate 1": the ARM calls, in order
    refusals: dict[str, int] = field(default_factory=dict)  # VM address -> Key Vault's 403s to it
    repository: Path | None = None  # the Slurm repository's files (dists/, pool/)
    repository_down_for: dict[str, float] = field(
        default_factory=dict
    )  # address -> seconds of 503 from its first request
    repository_first: dict[str, float] = field(default_factory=dict)
    repository_refusals: dict[str, int] = field(default_factory=dict)

    def issue(self, resource: str, client_id: str) -> str:
        token = _storage_token(client_id) if resource.rstrip("/") == STORAGE_RESOURCE else secrets.token_urlsafe(24)
        self.tokens[token] = (resource.rstrip("/"), client_id)
        return token

    def token_for(self, header: str | None, resource: str) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return scheme == "Bearer" and self.tokens.get(token, ("", ""))[0] == resource.rstrip("/")

    def forbid(self, address: str, seconds: float = math.inf) -> None:
        """Key Vault refuses the host at address for its first seconds of asking (RBAC still propagating),
        or until `allow`."""
        self.forbidden_for[address] = seconds

    def allow(self, address: str) -> None:
        self.forbidden_for[address] = 0

    def forbidden(self, address: str) -> bool:
        return _within(address, self.forbidden_for, self.first_read, self.refusals)

    def take_repository_down(self, address: str, seconds: float = math.inf) -> None:
        """The Slurm repository answers the host at address 503 for its first seconds of asking, or
        until `bring_repository_up`."""
        self.repository_down_for[address] = seconds

    def bring_repository_up(self, address: str) -> None:
        self.repository_down_for[address] = 0

    def repository_down(self, address: str) -> bool:
        return _within(address, self.repository_down_for, self.repository_first, self.repository_refusals)


def _storage_token(client_id: str) -> str:
    """A token for Azure Storage in Entra ID's shape (a JWT: audience, issuer, lifetime), which the
    results account's stand-in checks (tests/boot/blob.py); unsigned, as nothing here verifies one."""
    now = int(time.time())
    claims = {"aud": STORAGE_RESOURCE, "iss": f"https://sts.windows.net/{TENANT_ID}/", "iat": now, "nbf": now,
              "exp": now + 3600, "appid": client_id, "oid": client_id, "tid": TENANT_ID}  # fmt: skip
    parts = [{"alg": "none", "typ": "JWT"}, claims]
    encoded = [base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode() for part in parts]
    return ".".join([*encoded, "unsigned"])


def _within(address: str, window_s: dict[str, float], first: dict[str, float], counts: dict[str, int]) -> bool:
    """True (and counted) while address is within window_s[address] seconds of its first request."""
    started = first.setdefault(address, time.monotonic())
    if time.monotonic() - started < window_s.get(address, 0):
        counts[address] = counts.get(address, 0) + 1
        return True
    return False


def _reply(handler: BaseHTTPRequestHandler, status: int, body: object | None) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _error(handler: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    _reply(handler, status, {"error": {"code": code, "message": message}})


class ImdsHandler(MetadataHandler):
    """The local cluster's IMDS, with tokens, and every VM's own name."""

    server: ImdsServer

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == TOKEN_PATH and self.headers.get("Metadata", "").lower() == "true":
            query = {key: values[0] for key, values in parse_qs(url.query).items()}
            if "resource" not in query or "api-version" not in query:
                _reply(self, HTTPStatus.BAD_REQUEST, {"error": "invalid_request"})
                return
            token = self.server.azure.issue(query["resource"], query.get("client_id", ""))
            body = {"access_token": token, "expires_in": "86399", "token_type": "Bearer", "resource": query["resource"]}
            _reply(self, HTTPStatus.OK, body)
        elif url.path == NAME_PATH:
            self.server.node = self.server.azure.names.get(self.client_address[0], "")
            super().do_GET()
        else:
            super().do_GET()


class ImdsServer(MetadataServer):
    def __init__(self, azure: Azure, state_dir: Path, address: str) -> None:
        self.azure = azure
        ThreadingHTTPServer.__init__(self, (address, 80), ImdsHandler)
        self.state_dir, self.node = state_dir, ""


class AzureHandler(BaseHTTPRequestHandler):
    """Key Vault's secret read and ARM's scale-set calls, on one HTTPS port."""

    server: AzureServer

    def do_GET(self) -> None:
        azure, host, path = self.server.azure, self.headers.get("Host", ""), urlsplit(self.path).path
        if host == SLURM_REPOSITORY_HOST:
            self._repository_file(azure, path)
        elif host.endswith(".vault.azure.net"):
            self._secret(azure, path)
        elif host.endswith(".azurecr.io") and path == "/v2/":
            self._registry_login(azure)
        elif host == ARM_HOST and (match := _INSTANCE_VIEW.fullmatch(path)) and self._arm_allowed(match["scale_set"]):
            started = self.server.running().get(match["id"])  # Azure records when it last started one
            power = "PowerState/running" if started else "PowerState/deallocated"
            provisioned = {"code": "ProvisioningState/succeeded", **({"time": started} if started else {})}
            _reply(self, HTTPStatus.OK, {"statuses": [provisioned, {"code": power}]})
        else:
            _error(self, HTTPStatus.NOT_FOUND, "NotFound", f"{host}{path}")

    def do_POST(self) -> None:
        azure, host, path = self.server.azure, self.headers.get("Host", ""), urlsplit(self.path).path
        if host.endswith(".azurecr.io") and path == "/oauth2/exchange":
            self._registry_exchange(azure)
            return
        match = _SCALE_SET_CALL.fullmatch(path) if host == ARM_HOST else None
        if match is None:
            _error(self, HTTPStatus.NOT_FOUND, "NotFound", f"{host}{path}")
            return
        if not self._arm_allowed(match["scale_set"]):
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        # Resource Manager reads a body without instanceIds as every instance of the scale set.
        ids = [str(i) for i in body.get("instanceIds", azure.instances)]
        azure.calls.append(f"{match['action']} {','.join(ids)}")
        # Azure answers 202 at once and powers the instances in the background.
        threading.Thread(target=azure.power, args=(match["action"], ids), daemon=True).start()
        _reply(self, HTTPStatus.ACCEPTED, None)

    def _arm_allowed(self, scale_set: str) -> bool:
        azure = self.server.azure
        if not azure.token_for(self.headers.get("Authorization"), ARM_RESOURCE):
            _error(self, HTTPStatus.UNAUTHORIZED, "InvalidAuthenticationToken", "no token for ARM")
            return False
        if scale_set.lower() != azure.scale_set_id.lower():
            _error(self, HTTPStatus.NOT_FOUND, "ResourceNotFound", scale_set)
            return False
        return True

    def _registry_exchange(self, azure: Azure) -> None:
        form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
        if not azure.token_for(f"Bearer {form.get('access_token', [''])[0]}", ARM_RESOURCE):
            _error(self, HTTPStatus.UNAUTHORIZED, "UNAUTHORIZED", "not an ARM token")
            return
        _reply(self, HTTPStatus.OK, {"refresh_token": azure.issue("acr-refresh", ACR_TOKEN_USER)})

    def _registry_login(self, azure: Azure) -> None:
        scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
        user, _, password = base64.b64decode(encoded or "").decode(errors="replace").partition(":")
        if scheme == "Basic" and user == ACR_TOKEN_USER and azure.token_for(f"Bearer {password}", "acr-refresh"):
            _reply(self, HTTPStatus.OK, {})
            return
        self.send_response(HTTPStatus.UNAUTHORIZED)
        self.send_header("WWW-Authenticate", 'Basic realm="boot-test registry"')
        self.send_header("Docker-Distribution-Api-Version", "registry/2.0")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _repository_file(self, azure: Azure, path: str) -> None:
        prefix = urlsplit(SLURM_REPOSITORY_URL).path
        relative = Path(path.removeprefix(prefix))
        inside = path.startswith(prefix) and ".." not in relative.parts and azure.repository is not None
        file = azure.repository / relative if inside and azure.repository is not None else None
        if azure.repository_down(self.client_address[0]):
            _error(self, HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailable", "the repository is down (boot test)")
        elif file is None or not file.is_file():
            _error(self, HTTPStatus.NOT_FOUND, "NotFound", path)
        else:
            data = file.read_bytes()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", mimetypes.guess_type(file.name)[0] or "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def _secret(self, azure: Azure, path: str) -> None:
        match = _SECRET.fullmatch(path)
        if not azure.token_for(self.headers.get("Authorization"), VAULT_RESOURCE):
            _error(self, HTTPStatus.UNAUTHORIZED, "Unauthorized", "AKV10000: Request is missing a Bearer token.")
        elif azure.forbidden(self.client_address[0]):
            _error(self, HTTPStatus.FORBIDDEN, "Forbidden", "Caller is not authorized to perform action on resource.")
        elif match is None or match[1] not in azure.secrets:
            _error(self, HTTPStatus.NOT_FOUND, "SecretNotFound", path)
        else:
            _reply(self, HTTPStatus.OK, {"value": azure.secrets[match[1]], "id": f"{path}/1"})

    def log_message(self, format: str, *args: Any) -> None:
        pass


class AzureServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, azure: Azure, address: str, tls: ssl.SSLContext, running: Callable[[], dict[str, str]]) -> None:
        super().__init__((address, 443), AzureHandler)
        self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.azure, self.running = azure, running


@contextmanager
def serving(
    azure: Azure,
    *,
    address: str,
    imds_address: str,
    tls: ssl.SSLContext,
    state_dir: Path,
    running: Callable[[], dict[str, str]],  # instance id -> when it started (ISO 8601), for those running
) -> Iterator[None]:
    """IMDS and the HTTPS endpoints, each in a thread, for the length of the block."""
    servers: list[ThreadingHTTPServer] = [
        ImdsServer(azure, state_dir, imds_address),
        AzureServer(azure, address, tls, running),
    ]
    with ExitStack() as stack:
        for server in servers:
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            stack.callback(thread.join)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        yield
