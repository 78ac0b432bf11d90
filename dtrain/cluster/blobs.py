"""Blob access from the operator's machine (azure-storage-blob), for staging and for results."""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import ContainerClient, ContentSettings

from dtrain.cluster.description import BlobCredential, BlobLocation
from dtrain.errors import ExitCode, OperatorError
from dtrain.fileio import file_md5
from dtrain.remote.boot.blob_pull import explain_http_error

CHUNK = 1024 * 1024


def container_client(location: BlobLocation, credential: BlobCredential | None = None) -> ContainerClient:
    """A ContainerClient for a location, with its own credential or the one given."""
    cred = credential or location.credential
    secret = cred.secret.get_secret_value() if cred.secret else None
    kwargs = {"max_single_put_size": 8 * CHUNK, "connection_timeout": 20, "read_timeout": 120}
    if cred.kind == "connection_string":
        return ContainerClient.from_connection_string(secret, location.container, **kwargs)
    if cred.kind == "sas":
        return ContainerClient.from_container_url(f"{location.url}?{secret.lstrip('?')}", **kwargs)
    try:
        from azure.identity import DefaultAzureCredential, ManagedIdentityCredential
    except ImportError:  # pragma: no cover - azure-identity is in requirements.txt
        raise OperatorError(
            "azure-identity is needed for Entra ID access: pip install -r requirements.txt", ExitCode.NOT_READY
        ) from None
    if cred.kind == "managed_identity":  # only where that identity is assigned: a VM of the cluster
        identity = ManagedIdentityCredential(client_id=cred.client_id)
    else:
        identity = DefaultAzureCredential()
    return ContainerClient(location.endpoint, location.container, credential=identity, **kwargs)


def b64(digest: bytes | bytearray | None) -> str | None:
    return base64.b64encode(bytes(digest)).decode() if digest else None


def remote_md5s(client: ContainerClient, prefix: str = "") -> dict[str, str | None]:
    """name -> base64 Content-MD5 (None when the blob has none) for every blob under prefix."""
    return {b.name: b64(b.content_settings.content_md5) for b in client.list_blobs(name_starts_with=prefix or None)}


def upload_file(client: ContainerClient, path: Path, name: str, md5: bytes | None = None) -> int:
    """Upload one file with its Content-MD5 set (and checked in transit). Returns bytes sent."""
    md5 = md5 or file_md5(path)
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    size = path.stat().st_size
    with open(path, "rb") as handle:
        client.upload_blob(
            name,
            handle,
            length=size,
            overwrite=True,
            validate_content=True,
            content_settings=ContentSettings(content_type=content_type, content_md5=bytearray(md5)),
            max_concurrency=1,
        )
    return size


def explain(exc: Exception, what: str, sas: str | None = None) -> OperatorError:
    """A clear operator message for an azure-core error (authorization, missing container, ...)."""
    if isinstance(exc, HttpResponseError) and exc.status_code:
        body = b""
        try:
            body = exc.response.body() if exc.response is not None else b""
        except Exception:
            body = b""
        err = explain_http_error(exc.status_code, body or _xml(exc), sas, what)
        return OperatorError(str(err), err.exit_code)
    if isinstance(exc, ResourceNotFoundError):
        return OperatorError(f"not found while {what}: {exc.message}")
    if isinstance(exc, ClientAuthenticationError):
        return OperatorError(f"blob authorization failed while {what}: {exc.message}", ExitCode.NOT_READY)
    if isinstance(exc, ServiceRequestError | ServiceResponseError):
        return OperatorError(f"blob storage unreachable while {what}: {exc}", ExitCode.NOT_READY)
    return OperatorError(f"blob storage error while {what}: {exc}", ExitCode.FAILED)


def _xml(exc: HttpResponseError) -> bytes:
    code = getattr(exc, "error_code", None) or ""
    return f"<Error><Code>{code}</Code><Message></Message></Error>".encode()
