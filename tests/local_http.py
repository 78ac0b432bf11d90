"""A real HTTP server on loopback, for the cloud endpoints the suites cannot reach (IMDS, ARM, the
Retail Prices API, a storage account that refuses): shared by the suites of both environments."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """Serve ``handler`` on a free loopback port in a thread; yield ``http://127.0.0.1:PORT``, or
    ``https://...`` with a server context (tests/boot/tls.py makes a CA and a certificate for it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def reply_json(handler: http.server.BaseHTTPRequestHandler, status: int, body: object) -> None:
    """Answer the handler's request with status and body as JSON, as Azure's endpoints do."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
