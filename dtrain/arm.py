"""Azure Resource Manager's REST API, read with the operator's Entra ID login (runs on the operator's
machine; `dtrain doctor` is its user).

The token comes from azure-identity's DefaultAzureCredential, the login the other commands use for
blobs: a service principal in the environment (AZURE_CLIENT_ID, ...), a managed identity, then the
Azure CLI's `az login`. Requests are plain HTTPS GETs with it as a bearer token; a redirect is not
followed, and a next page is fetched only from the same endpoint, so the token goes nowhere else.

DTRAIN_ARM_ENDPOINT replaces https://management.azure.com (a sovereign cloud's Resource Manager, or a
test's server); it is also the token's audience. It must be https: the token is a bearer token.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from dtrain.errors import ExitCode, OperatorError

ARM_ENDPOINT_ENV = "DTRAIN_ARM_ENDPOINT"
DEFAULT_ARM_ENDPOINT = "https://management.azure.com"
TIMEOUT_S = 30
MAX_PAGES = 50


class NoCredential(Exception):
    """No way of signing in to Azure worked; the message says why each failed (for --debug)."""


class ArmError(Exception):
    """Resource Manager answered with an error: its HTTP status and its error code and message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{code} (HTTP {status})")
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class Principal:
    """Who the token speaks for, from its claims: ARM's role assignments name it by object id."""

    object_id: str | None
    name: str  # a user's sign-in name, or a service principal's application id


def arm_endpoint() -> str:
    endpoint = os.environ.get(ARM_ENDPOINT_ENV, "").strip() or DEFAULT_ARM_ENDPOINT
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "https" or not parts.netloc or parts.query or parts.fragment:
        raise OperatorError(f"{ARM_ENDPOINT_ENV}={endpoint!r} is not an https:// URL (the token is a bearer token)")
    return endpoint.rstrip("/")


class Arm:
    """GET requests to Resource Manager with one token."""

    def __init__(self, endpoint: str, token: str):
        self.endpoint = endpoint
        self._token = token
        self._opener = urllib.request.build_opener(_NoRedirect)

    @classmethod
    def sign_in(cls, endpoint: str) -> Arm:
        """A token for Resource Manager from DefaultAzureCredential, or NoCredential."""
        from azure.core.exceptions import ClientAuthenticationError
        from azure.identity import DefaultAzureCredential

        # azure-identity logs each failed way of signing in as a warning; the caller says it in one line.
        logging.getLogger("azure").addHandler(logging.NullHandler())
        try:
            with DefaultAzureCredential() as credential:
                token = credential.get_token(f"{endpoint}/.default").token
        except ClientAuthenticationError as exc:
            raise NoCredential(str(exc)) from None
        return cls(endpoint, token)

    @property
    def principal(self) -> Principal:
        claims = _claims(self._token)
        name = claims.get("upn") or claims.get("unique_name") or claims.get("preferred_username")
        name = name or (f"application {claims['appid']}" if claims.get("appid") else "an unnamed principal")
        return Principal(object_id=claims.get("oid"), name=str(name))

    def get(self, path: str, api_version: str, **query: str) -> dict[str, Any]:
        """GET {endpoint}{path}?api-version=...&query: the JSON object, or ArmError."""
        return self._get(self._url(path, api_version, query))

    def get_all(self, path: str, api_version: str, **query: str) -> list[dict[str, Any]]:
        """Every item of a list, following nextLink on this endpoint."""
        url: str | None = self._url(path, api_version, query)
        items: list[dict[str, Any]] = []
        for _ in range(MAX_PAGES):
            if not url:
                return items
            page = self._get(url)
            items += [item for item in page.get("value") or [] if isinstance(item, dict)]
            url = page.get("nextLink")
            if url and not url.startswith(f"{self.endpoint}/"):
                raise OperatorError(f"Resource Manager's next page is elsewhere ({url}): not sending the token there")
        raise OperatorError(f"Resource Manager kept paging {path} past {MAX_PAGES} pages", ExitCode.NOT_READY)

    def _url(self, path: str, api_version: str, query: dict[str, str]) -> str:
        return f"{self.endpoint}{path}?{urllib.parse.urlencode({'api-version': api_version, **query})}"

    def _get(self, url: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        try:
            with self._opener.open(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise _arm_error(exc) from None
        except (OSError, http.client.HTTPException) as exc:
            reason = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
            raise OperatorError(
                f"cannot reach Azure Resource Manager at {self.endpoint}: {reason} (check the network; "
                f"{ARM_ENDPOINT_ENV} names another endpoint)",
                ExitCode.NOT_READY,
            ) from None
        except ValueError:
            raise OperatorError(f"Resource Manager's answer to {url} is not JSON", ExitCode.NOT_READY) from None
        if not isinstance(body, dict):
            raise OperatorError(f"Resource Manager's answer to {url} is not a JSON object", ExitCode.NOT_READY)
        return body


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect comes back as an error: following it would send the token to another address."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _arm_error(exc: urllib.error.HTTPError) -> ArmError:
    """ARM's error body is {"error": {"code": ..., "message": ...}}; anything else keeps the HTTP reason."""
    try:
        error = json.loads(exc.read()).get("error") or {}
    except (ValueError, AttributeError, OSError):
        error = {}
    return ArmError(exc.code, str(error.get("code") or exc.reason), str(error.get("message") or ""))


def _claims(token: str) -> dict[str, Any]:
    """The claims of a JWT access token (read, not verified: Resource Manager verifies it). An opaque
    token has none."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError, binascii.Error):
        return {}
    return claims if isinstance(claims, dict) else {}
