#!/usr/bin/env python3
"""blob-pull: copy a blob container (or a prefix of it) into a directory, verified by Content-MD5.

Standard library only, Python 3.8+: cloud-init ships this file verbatim onto the NFS server as
/usr/local/bin/blob-pull, and the operator's `stage pull` runs it there over SSH.

  BLOB_SAS=... blob-pull --container-url https://ACCOUNT.blob.core.windows.net/data --dest /export/data
  blob-pull --container-url URL --dest DIR --prefix imagenet/ < sas.txt

The SAS token (read + list is enough) comes from the environment variable named by --sas-env
(default BLOB_SAS) or, when that is unset, from the first line of stdin. Never from argv: the
command line of a process is visible to every user in `ps`.

Blobs are listed with the List Blobs REST call (marker pagination) and downloaded in parallel.
A file whose size and MD5 already match the blob's Content-MD5 is skipped, so a rerun after an
interruption fetches only what is missing or different. Every download is checked against
Content-MD5 before it is moved into place (written to a temporary name, then renamed).
With --unpack-tars, downloaded `*.tar` shards are also extracted into DEST (once per shard content).

Progress on stderr every 2 s and at the end: blobs and bytes present out of those listed, and the rate.
The last line on stdout is a JSON summary: listed, downloaded, skipped, present, failed, bytes, ...
(or {"error": ...}). Exit status: 0 all present and verified; 1 some blobs failed (or an internal
error); 2 bad arguments, destination or container URL; 3 storage unreachable or access refused
(SAS); 130 interrupted. --debug (or SCRIPTS_DEBUG=1) adds the traceback of an error.
"""

import argparse
import base64
import contextlib
import errno
import hashlib
import http.client
import json
import os
import sys
import tarfile
import threading
import time
import traceback
import urllib.parse
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone

API_VERSION = "2021-08-06"
CHUNK = 1024 * 1024
RETRIES = 4
MARKER_DIR = ".blob-pull"
# The exit-status table of dtrain/errors.py, repeated: this file must stand alone on the NFS server.
EXIT_FAILED = 1  # some blobs failed, or an unexpected internal error
EXIT_BAD_INPUT = 2  # arguments, destination, container URL
EXIT_NOT_READY = 3  # storage unreachable or access refused, disk full
EXIT_INTERRUPTED = 130
DEBUG_ENV = "SCRIPTS_DEBUG"


class BlobError(Exception):
    """An error with a message meant for the operator, and the exit status it means."""

    def __init__(self, message, status=None, code=None, exit_code=EXIT_BAD_INPUT):
        Exception.__init__(self, message)
        self.status = status
        self.code = code
        self.exit_code = exit_code


def _sas_expiry(sas):
    """The `se` (signed expiry) of a SAS token as an aware datetime, or None."""
    values = urllib.parse.parse_qs(sas).get("se")
    if not values:
        return None
    text = values[0].replace("Z", "+00:00")
    try:
        expiry = datetime.fromisoformat(text)
    except ValueError:
        return None
    if expiry.tzinfo is None:
        expiry = expiry.replace(tzinfo=timezone.utc)  # noqa: UP017 - runs on Python 3.8+
    return expiry


def _http_exit_code(status):
    """401/403: the service refused us; 5xx: it failed; anything else: the request (URL, names) is wrong."""
    if status in (401, 403):
        return EXIT_NOT_READY
    return EXIT_FAILED if status >= 500 else EXIT_BAD_INPUT


def explain_http_error(status, body, sas, what):
    """Turn a Blob service error response into one clear sentence (a BlobError with its exit status)."""
    code = message = ""
    try:
        root = ET.fromstring(body)
        code = (root.findtext("Code") or "").strip()
        message = (root.findtext("Message") or "").strip().splitlines()[0] if root.findtext("Message") else ""
    except ET.ParseError:
        pass
    if status in (401, 403):
        expiry = _sas_expiry(sas) if sas else None
        now = datetime.now(timezone.utc)  # noqa: UP017 - runs on Python 3.8+
        if expiry is not None and expiry <= now:
            text = f"blob authorization failed while {what}: the SAS token expired at {expiry:%Y-%m-%dT%H:%M:%SZ}"
        elif code == "AuthorizationPermissionMismatch":
            text = f"blob authorization failed while {what}: the SAS token does not grant this permission"
        elif code in ("AuthenticationFailed", "AuthorizationFailure", "NoAuthenticationInformation"):
            text = f"blob authorization failed while {what}: the SAS token is wrong, expired or not for this container"
        else:
            text = f"blob authorization failed while {what}"
        text += f" (HTTP {status} {code or 'Forbidden'})"
    elif status == 404 and code == "ContainerNotFound":
        text = f"container not found while {what} (HTTP 404 ContainerNotFound)"
    else:
        text = f"blob service error while {what}: HTTP {status} {code}" + ((": " + message) if message else "")
    return BlobError(text, status, code, _http_exit_code(status))


def split_container_url(container_url):
    parsed = urllib.parse.urlsplit(container_url.strip().rstrip("/"))
    if parsed.scheme not in ("http", "https") or not parsed.netloc or not parsed.path.strip("/"):
        raise BlobError(f"--container-url must be an http(s) URL of a container, got {container_url!r}")
    if parsed.query:
        raise BlobError("--container-url must not carry a query string: pass the SAS via the environment")
    return parsed


def prepare_dest(dest):
    """The destination directory, created if missing; a clear BlobError when it cannot be one."""
    if not dest.strip():
        raise BlobError("--dest must not be empty")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise BlobError(f"--dest {dest} is a file, not a directory")
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise BlobError(f"cannot create --dest {dest}: {exc.strerror}") from None
    if not os.access(dest, os.W_OK | os.X_OK):
        raise BlobError(f"cannot write to --dest {dest}: read-only or no permission")


def _backoff(attempt):
    """Wait before the next attempt; not after the last one."""
    if attempt + 1 < RETRIES:
        time.sleep(0.5 * 2**attempt)


class Container:
    """A container URL plus SAS, with one persistent HTTP(S) connection per thread."""

    def __init__(self, container_url, sas, timeout=60):
        parsed = split_container_url(container_url)
        self.scheme = parsed.scheme
        self.netloc = parsed.netloc
        self.path = parsed.path
        self.sas = sas.lstrip("?")
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = cls(self.netloc, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _drop_connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def request(self, method, path, query):
        """Send a request; return the open response (status < 300) or raise BlobError."""
        parts = [p for p in (query, self.sas) if p]
        url = path + ("?" + "&".join(parts) if parts else "")
        headers = {"x-ms-version": API_VERSION, "x-ms-date": _http_date()}
        last = None
        for attempt in range(RETRIES):
            try:
                conn = self._connection()
                conn.request(method, url, headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self._drop_connection()
                last = exc
                _backoff(attempt)
                continue
            if response.status < 300:
                return response
            body = response.read()
            if response.status >= 500 or response.status == 408:
                last = explain_http_error(response.status, body, self.sas, method + " " + path)
                _backoff(attempt)
                continue
            raise explain_http_error(response.status, body, self.sas, _describe(method, path, self.path))
        if isinstance(last, BlobError):
            raise last
        raise BlobError(f"cannot reach {self.scheme}://{self.netloc}: {last}", exit_code=EXIT_NOT_READY)

    def list_blobs(self, prefix=""):
        """Yield dicts (name, size, md5 base64 or None) for every blob under prefix, all pages."""
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "maxresults": "5000"}
            if prefix:
                query["prefix"] = prefix
            if marker:
                query["marker"] = marker
            response = self.request("GET", self.path, urllib.parse.urlencode(query))
            root = self._listing(response.read())
            for blob in root.iter("Blob"):
                props = blob.find("Properties")
                md5 = props.findtext("Content-MD5") if props is not None else None
                yield {
                    "name": blob.findtext("Name"),
                    "size": int(props.findtext("Content-Length") or 0) if props is not None else 0,
                    "md5": md5 or None,
                }
            marker = (root.findtext("NextMarker") or "").strip()
            if not marker:
                return

    def _listing(self, body):
        try:
            root = ET.fromstring(body)
        except ET.ParseError:
            root = None
        if root is None or root.tag != "EnumerationResults":
            raise BlobError(
                f"{self.scheme}://{self.netloc}{self.path} did not answer with a blob listing: "
                "is --container-url the URL of a blob container?"
            )
        return root

    def blob_path(self, name):
        return self.path + "/" + urllib.parse.quote(name, safe="/~")


def _describe(method, path, container_path):
    if method == "GET" and path == container_path:
        return "listing the container"
    return "reading " + urllib.parse.unquote(path[len(container_path) + 1 :])


def _http_date():
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime())


def file_md5(path):
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode("ascii")


def local_path(dest, name, prefix):
    """Where a blob lands: DEST/<name without prefix>; refuse names that would escape DEST."""
    relative = name[len(prefix) :] if prefix and name.startswith(prefix) else name
    parts = [p for p in relative.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or relative.startswith("/"):
        raise BlobError(f"refusing blob name {name!r}: it would land outside the destination")
    return os.path.join(dest, *parts)


def download(container, blob, target):
    """Download one blob to target via a temporary file, verifying Content-MD5. Returns bytes."""
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(target)}.part-{threading.get_ident()}")
    last = None
    for attempt in range(RETRIES):
        digest = hashlib.md5()
        size = 0
        try:
            response = container.request("GET", container.blob_path(blob["name"]), "")
            expected = blob["md5"] or response.getheader("Content-MD5")
            with open(temp, "wb") as handle:
                while True:
                    chunk = response.read(CHUNK)
                    if not chunk:
                        break
                    digest.update(chunk)
                    handle.write(chunk)
                    size += len(chunk)
        except (OSError, http.client.HTTPException) as exc:
            container._drop_connection()
            last = exc
            _backoff(attempt)
            continue
        except BaseException:
            _remove(temp)
            raise
        got = base64.b64encode(digest.digest()).decode("ascii")
        if size != blob["size"] or (expected and got != expected):
            _remove(temp)
            raise BlobError(
                f"MD5 verification failed for {blob['name']}: expected {expected} ({blob['size']} bytes), "
                f"downloaded {got} ({size} bytes)"
            )
        os.replace(temp, target)
        return size, bool(expected)
    _remove(temp)
    raise BlobError(f"download of {blob['name']} failed after {RETRIES} attempts: {last}")


def _remove(path):
    with contextlib.suppress(OSError):
        os.remove(path)


def unpack_tar(path, dest, md5):
    """Extract a shard into dest once per content (a marker file remembers the MD5)."""
    marker_dir = os.path.join(dest, MARKER_DIR)
    token = hashlib.sha1((os.path.relpath(path, dest) + ":" + (md5 or "")).encode()).hexdigest()
    marker = os.path.join(marker_dir, token + ".unpacked")
    if os.path.exists(marker):
        return 0
    with tarfile.open(path) as archive:
        members = archive.getmembers()
        for member in members:
            name = member.name
            if name.startswith("/") or ".." in name.split("/") or not (member.isfile() or member.isdir()):
                raise BlobError(f"refusing to unpack {path}: unsafe member {name!r}")
        if hasattr(tarfile, "data_filter"):
            archive.extractall(dest, filter="data")
        else:  # pragma: no cover - Python < 3.8.17 / 3.10.12 without extraction filters
            archive.extractall(dest)
    os.makedirs(marker_dir, exist_ok=True)
    with open(marker, "w") as handle:
        handle.write(path + "\n")
    return sum(1 for m in members if m.isfile())


def pull(container_url, sas, dest, prefix="", workers=8, unpack_tars=False, progress=None):
    """Copy every blob under prefix into dest. Returns the summary dict."""
    started = time.time()
    container = Container(container_url, sas)
    prepare_dest(dest)
    blobs = list(container.list_blobs(prefix))
    summary = {
        "listed": len(blobs),
        "downloaded": 0,
        "skipped": 0,
        "present": 0,
        "failed": 0,
        "unverified": 0,
        "unpacked_files": 0,
        "bytes": 0,
        "listed_bytes": sum(blob["size"] for blob in blobs),  # the totals progress is measured against
        "present_bytes": 0,
        "errors": [],
    }
    lock = threading.Lock()

    def one(blob):
        target = local_path(dest, blob["name"], prefix)
        same_size = os.path.isfile(target) and os.path.getsize(target) == blob["size"]
        if blob["md5"] and same_size and file_md5(target) == blob["md5"]:
            return "skipped", 0, True, target
        size, verified = download(container, blob, target)
        return "downloaded", size, verified, target

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(one, blob): blob for blob in blobs}
        for future in as_completed(futures):
            blob = futures[future]
            try:
                outcome, size, verified, target = future.result()
            except BlobError as exc:
                if exc.status in (401, 403):
                    for other in futures:
                        other.cancel()
                    raise
                with lock:
                    summary["failed"] += 1
                    summary["errors"].append(str(exc))
                continue
            summary[outcome] += 1
            summary["present"] += 1
            summary["bytes"] += size
            summary["present_bytes"] += blob["size"]
            if not verified:
                summary["unverified"] += 1
            if unpack_tars and blob["name"].endswith(".tar"):
                try:
                    summary["unpacked_files"] += unpack_tar(target, dest, blob["md5"])
                except (BlobError, tarfile.TarError, OSError) as exc:  # a bad shard fails, the pull goes on
                    summary["failed"] += 1
                    summary["errors"].append(f"cannot unpack {blob['name']}: {exc}")
            if progress:
                progress(summary)
    summary["seconds"] = round(time.time() - started, 3)
    return summary


def read_sas(env_name):
    sas = os.environ.get(env_name, "").strip()
    if not sas and not sys.stdin.isatty():
        sas = sys.stdin.readline().strip()
    if not sas:
        raise BlobError(f"no SAS token: set {env_name} in the environment or pass it on stdin")
    return sas.lstrip("?")


def _whole_number_at_least_1(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="blob-pull",
        description="Copy a blob container (or prefix) into a directory, resumable and MD5-verified. "
        "The SAS token comes from the environment (--sas-env, default BLOB_SAS) or stdin, never argv.",
        epilog="Exit status: 0 ok; 1 some blobs failed (or an internal error); 2 bad input; "
        "3 storage unreachable or access refused; 130 interrupted.",
    )
    parser.add_argument("--container-url", required=True, help="https://ACCOUNT.blob.core.windows.net/CONTAINER")
    parser.add_argument("--dest", required=True, help="destination directory (created if missing)")
    parser.add_argument("--prefix", default="", help="only blobs whose names start with this; it is stripped")
    parser.add_argument("--workers", type=_whole_number_at_least_1, default=8, help="parallel downloads (default 8)")
    parser.add_argument("--unpack-tars", action="store_true", help="extract downloaded *.tar shards into DEST")
    parser.add_argument("--sas-env", default="BLOB_SAS", help="environment variable holding the SAS token")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def progress_line(summary, seconds):
    """Blobs and bytes present out of those listed, and the download rate so far."""
    done, total = summary["present_bytes"], summary["listed_bytes"]
    share = 100 * done / total if total else 100
    return (
        f"blob-pull: {summary['present']}/{summary['listed']} blobs, {done / 1e6:.1f}/{total / 1e6:.1f} MB "
        f"({share:.0f}%), {summary['bytes'] / 1e6 / max(seconds, 1e-6):.1f} MB/s, {summary['failed']} failed"
    )


def run(args):
    """Check the arguments, pull, print the summary; returns the exit status."""
    started = time.time()
    last = [started]

    def progress(summary):
        now = time.time()
        if not args.quiet and now - last[0] > 2:
            last[0] = now
            sys.stderr.write(progress_line(summary, now - started) + "\n")

    split_container_url(args.container_url)  # argument errors first, before asking for the SAS
    prepare_dest(args.dest)
    sas = read_sas(args.sas_env)
    summary = pull(args.container_url, sas, args.dest, args.prefix, args.workers, args.unpack_tars, progress)
    if not args.quiet:  # the totals reached, whatever the pace of the lines before
        sys.stderr.write(progress_line(summary, summary["seconds"]) + "\n")
    for error in summary["errors"][:20]:
        sys.stderr.write(f"blob-pull: {error}\n")
    sys.stderr.write(
        "blob-pull: {listed} listed, {downloaded} downloaded, {skipped} already present, "
        "{failed} failed, {bytes} bytes in {seconds:.1f}s\n".format(**summary)
    )
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if summary["failed"] == 0 else EXIT_FAILED


def _fail(message, exit_code, debug):
    """The one error path: a traceback only when asked for, the message on stderr, JSON on stdout."""
    if debug:
        traceback.print_exc()
    sys.stderr.write(f"blob-pull: error: {message}\n")
    sys.stdout.write(json.dumps({"error": message}) + "\n")
    return exit_code


def _describe_unexpected(exc):
    if isinstance(exc, OSError) and exc.filename is not None:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        return f"cannot use {exc.filename}: {exc.strerror}", EXIT_NOT_READY if full else EXIT_BAD_INPUT
    return f"unexpected {type(exc).__name__}: {exc}", EXIT_FAILED


def main(argv=None):
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return run(args)
    except BlobError as exc:
        return _fail(str(exc), exc.exit_code, debug)
    except KeyboardInterrupt:
        return _fail("interrupted; rerun to resume", EXIT_INTERRUPTED, debug)
    except Exception as exc:  # the safety net: whatever slipped past the checks gets a message too
        message, code = _describe_unexpected(exc)
        return _fail(message if debug else message + " (run again with --debug for the traceback)", code, debug)


if __name__ == "__main__":
    sys.exit(main())
