#!/usr/bin/env python3
"""upload-results: copy a run directory to the results container, from the cluster, when the job ends.

Standard library only, Python 3.10+: the batch script (job.sh) runs it on the first node with the
node's python3, from the run's `remote/` directory, whether or not the operator is still attached.

  python3 upload_results.py --dir RUN_DIR --account-url https://ACCOUNT.blob.core.windows.net \\
      --container results --prefix RUN_ID --managed-identity --client-id CLIENT_ID
  python3 upload_results.py --dir RUN_DIR --account-url http://127.0.0.1:10000/devstoreaccount1 \\
      --container results --prefix RUN_ID --sas-file RUN_DIR/results.sas

Every file under RUN_DIR goes to the block blob <prefix>/<relative path> (8 at a time, smallest first,
after a first one alone that tests the credential), except the directories `checkpoints/` (which
checkpoint_mirror.py copies while the job runs, and --with-checkpoints here makes its last pass over,
in this process, before --status: `launch --resume-from` starts from them), `remote/` (copies of these
tools) and `code/` (the user's --workdir, which stays on the share beside the run), `secrets/` (a task's secrets),
any `*.sas` file (secrets never leave) and symbolic links. Files up to 64 MiB are sent with one
Put Blob, larger ones in blocks (Put Block, then Put Block List); every request carries the MD5 of
its body, and the blob keeps the MD5 of the whole file.

Credentials, never on the command line (it shows in `ps`), never printed:
  --sas-file FILE          a SAS token (create + write on the container) on the file's first line;
  --managed-identity       a token from the VM's instance metadata service (IMDS) for the identity
                           given by --client-id (or the VM's only one), sent as a Bearer token over
                           HTTPS. The environment variable IMDS_ENDPOINT replaces the IMDS token URL.
Requests are tried 3 times, with a pause, on a server error (5xx, 408, 429) or a broken connection.

--status FILE (the job's status.json, relative to RUN_DIR) goes last, once its "results" says what
the rest came to: "uploaded", "incomplete" with the files that failed in "not_uploaded", or "failed"
with "results_error" (then it stays on the shared file system only).

The last line on stdout: `uploaded N files (X MB) to URL/CONTAINER/PREFIX/`. Exit status: 0 all
uploaded; 1 the storage service failed (for some files: each is named on stderr); 2 bad arguments
(directory, URL, names); 3 access refused (SAS or identity without write permission, expired) or
storage / IMDS unreachable; 130 interrupted.
"""

import argparse
import base64
import concurrent.futures
import contextlib
import hashlib
import http.client
import json
import mimetypes
import os
import sys
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET

API_VERSION = "2021-08-06"
SINGLE_PUT_LIMIT = 64 * 1024 * 1024  # larger files go in blocks
BLOCK_SIZE = 16 * 1024 * 1024
TRIES = 3
TIMEOUT_S = 120
UPLOAD_THREADS = 8  # files in flight at once: a run's upload must fit in KillWait after a cancel
PROGRESS_EVERY_S = 5  # a progress line at most this often: a large checkpoint takes minutes
IMDS_TOKEN_URL = "http://169.254.169.254/metadata/identity/oauth2/token"
STORAGE_RESOURCE = "https://storage.azure.com/"
CHECKPOINTS = "checkpoints"  # $CHECKPOINT_DIR: checkpoint_mirror.py's, not uploaded with the rest
SKIPPED_DIRS = (CHECKPOINTS, "remote", "code", "secrets")  # at the top of the run directory
SECRET_SUFFIX = ".sas"
RETRIED_STATUSES = (408, 429)  # and every 5xx
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_READY = 3
EXIT_INTERRUPTED = 130


class UploadError(Exception):
    """An error with a message meant for the operator, and the exit status it means."""

    def __init__(self, message, exit_code=EXIT_FAILED):
        Exception.__init__(self, message)
        self.exit_code = exit_code


# --- HTTP --------------------------------------------------------------------------------------
class Endpoint:
    """One HTTP(S) server, one persistent connection to it, requests retried on transient failures."""

    def __init__(self, url, timeout=TIMEOUT_S):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UploadError(f"not an http(s) URL: {url!r}", EXIT_BAD_INPUT)
        self.scheme, self.netloc, self.path = parts.scheme, parts.netloc, parts.path.rstrip("/")
        self.timeout = timeout
        self.connection = None

    def _connect(self):
        if self.connection is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            self.connection = cls(self.netloc, timeout=self.timeout)
        return self.connection

    def _drop(self):
        if self.connection is not None:
            self.connection.close()
        self.connection = None

    def request(self, method, path, headers, body=b""):
        """-> (status, body bytes): the first answer that is not a transient failure, or the last one.
        Raises UploadError(EXIT_NOT_READY) when no answer came in TRIES attempts."""
        failure = None
        for attempt in range(TRIES):
            if attempt:
                time.sleep(0.5 * 2**attempt)
            try:
                connection = self._connect()
                connection.request(method, path, body=body, headers=headers)
                response = connection.getresponse()
                status, data = response.status, response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                failure = None, f"{type(exc).__name__}: {exc}"
                continue
            if status < 500 and status not in RETRIED_STATUSES:
                return status, data
            failure = status, data
        status, data = failure
        if status is None:
            raise UploadError(f"cannot reach {self.scheme}://{self.netloc} ({data}, {TRIES} tries)", EXIT_NOT_READY)
        return status, data


# --- credentials -------------------------------------------------------------------------------
def read_sas(path):
    """The SAS token on the first line of path (a leading `?` dropped)."""
    try:
        with open(path, encoding="utf-8") as handle:
            sas = handle.readline().strip().lstrip("?")
    except OSError as exc:
        raise UploadError(f"cannot read --sas-file {path}: {exc.strerror}", EXIT_BAD_INPUT) from None
    if "sig=" not in sas:
        raise UploadError(f"--sas-file {path} does not hold a SAS token (no sig= on its first line)", EXIT_BAD_INPUT)
    return sas


def imds_token(client_id=None, token_url=None):
    """An access token for Azure Storage from the instance metadata service, for the managed identity
    client_id (or the VM's only identity)."""
    url = token_url or os.environ.get("IMDS_ENDPOINT") or IMDS_TOKEN_URL
    endpoint = Endpoint(url, timeout=10)  # IMDS answers at once on a VM; elsewhere, fail soon
    query = {"api-version": "2018-02-01", "resource": STORAGE_RESOURCE}
    if client_id:
        query["client_id"] = client_id
    who = f"the managed identity {client_id}" if client_id else "the VM's managed identity"
    try:
        status, body = endpoint.request("GET", f"{endpoint.path}?{urllib.parse.urlencode(query)}", {"Metadata": "true"})
    except UploadError as exc:
        raise UploadError(f"no token for {who}: {exc} (is this an Azure VM?)", EXIT_NOT_READY) from None
    try:
        reply = json.loads(body)
    except ValueError:
        reply = {}
    if status != 200:
        why = reply.get("error_description") or reply.get("error") or body[:200].decode("utf-8", "replace")
        raise UploadError(
            f"no token for {who}: IMDS answered HTTP {status}: {why} (is the identity assigned to this VM?)",
            EXIT_NOT_READY,
        )
    token = reply.get("access_token") if isinstance(reply, dict) else None
    if not token:
        raise UploadError(f"no token for {who}: the IMDS reply holds no access_token", EXIT_FAILED)
    return token


# --- the container -----------------------------------------------------------------------------
class Container:
    """A blob container, reached with a SAS (appended to every URL) or a Bearer token (a header): set
    one of `sas` and `token` once the URL has been checked."""

    def __init__(self, account_url, name):
        self.endpoint = Endpoint(account_url)
        if urllib.parse.urlsplit(account_url).query:
            raise UploadError("--account-url must not carry a query string: pass the SAS in --sas-file", EXIT_BAD_INPUT)
        self.name = name
        self.url = f"{account_url.rstrip('/')}/{name}"
        self.sas = None
        self.token = None

    def clone(self):
        """The same container and credential, over a connection of its own (for another thread)."""
        other = Container(f"{self.endpoint.scheme}://{self.endpoint.netloc}{self.endpoint.path}", self.name)
        other.sas, other.token = self.sas, self.token
        return other

    @property
    def credential(self):
        return "the SAS" if self.sas else "the managed identity"

    def send(self, method, blob, query, headers, body=b""):
        """One authorized request to a blob (blob None: the container; query: e.g. comp=block) ->
        (status, body bytes)."""
        path = f"{self.endpoint.path}/{self.name}"
        if blob is not None:
            path += f"/{urllib.parse.quote(blob, safe='/')}"
        parts = [p for p in (query, self.sas) if p]
        if parts:
            path += "?" + "&".join(parts)
        headers = {
            "x-ms-version": API_VERSION,
            "x-ms-date": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()),
            **headers,
        }
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return self.endpoint.request(method, path, headers, body)

    def put(self, blob, query, body, headers):
        """PUT to a blob (query: its operation, e.g. comp=block); raises UploadError unless 201."""
        status, data = self.send("PUT", blob, query, {"Content-MD5": md5_base64(body), **headers}, body)
        if status != 201:
            raise self.explain(status, data, blob)

    def explain(self, status, data, blob):
        """A refused request as one sentence that names the blob, the HTTP status and what to do."""
        code = error_code(data)
        what = f"cannot upload {blob} to {self.url}: HTTP {status}" + (f" {code}" if code else "")
        if status in (401, 403):
            return UploadError(
                f"{what}: {self.credential} lacks write permission on the container {self.name} (or has expired)",
                EXIT_NOT_READY,
            )
        if status == 404 and code == "ContainerNotFound":
            return UploadError(f"{what}: the container {self.name} does not exist", EXIT_BAD_INPUT)
        if status >= 500 or status in RETRIED_STATUSES:
            return UploadError(f"{what} ({TRIES} tries)", EXIT_FAILED)
        return UploadError(what, EXIT_BAD_INPUT)


def md5_base64(data):
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


def content_type(path):
    if path.endswith(".log"):
        return "text/plain; charset=utf-8"
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def upload_file(container, path, blob, single_put_limit=SINGLE_PUT_LIMIT, block_size=BLOCK_SIZE):
    """Upload one file as a block blob: one Put Blob up to single_put_limit bytes, blocks beyond.
    Returns its size in bytes."""
    kind = content_type(path)
    with open(path, "rb") as handle:
        head = handle.read(single_put_limit + 1)
        if len(head) <= single_put_limit:
            container.put(blob, "", head, {"x-ms-blob-type": "BlockBlob", "x-ms-blob-content-type": kind})
            return len(head)
        return _upload_blocks(container, handle, head, blob, kind, block_size)


def _upload_blocks(container, handle, head, blob, kind, block_size):
    """Put Block for every block_size piece of head (what was read already) and of the rest of the
    file, then Put Block List, with the MD5 of the whole file."""
    digest, ids, size = hashlib.md5(), [], 0
    chunk = head
    while chunk:
        for start in range(0, len(chunk), block_size):
            block = chunk[start : start + block_size]
            block_id = base64.b64encode(f"{len(ids):08d}".encode()).decode("ascii")  # all ids one length
            container.put(blob, f"comp=block&blockid={urllib.parse.quote(block_id, safe='')}", block, {})
            digest.update(block)
            ids.append(block_id)
            size += len(block)
        chunk = handle.read(block_size)
    listing = "".join(f"<Latest>{block_id}</Latest>" for block_id in ids)
    body = f'<?xml version="1.0" encoding="utf-8"?><BlockList>{listing}</BlockList>'.encode()
    headers = {"x-ms-blob-content-type": kind, "x-ms-blob-content-md5": base64.b64encode(digest.digest()).decode()}
    container.put(blob, "comp=blocklist", body, headers)
    return size


# --- the run directory -------------------------------------------------------------------------
def error_code(data):
    """The storage error's Code from an error response's XML body, or ''."""
    try:
        return (ET.fromstring(data).findtext("Code") or "").strip()
    except ET.ParseError:
        return ""


def files_to_upload(run_dir):
    """(path, relative POSIX path) of every regular file to upload, sorted; see the module's docstring."""
    found = []
    for root, dirs, files in os.walk(run_dir):
        relative_root = os.path.relpath(root, run_dir)
        if relative_root == ".":
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(SECRET_SUFFIX) or os.path.islink(path) or not os.path.isfile(path):
                continue
            found.append((path, os.path.relpath(path, run_dir).replace(os.sep, "/")))
    return sorted(found, key=lambda item: item[1])


class Progress:
    """Files and bytes done out of the totals, with the rate, on stdout every `every` seconds (job.sh
    prefixes them [job], so `launch --follow` and the log show them) and once at the end."""

    def __init__(self, files, total_bytes, every=PROGRESS_EVERY_S):
        self.files, self.total, self.every = files, total_bytes, every
        self.done_files = self.done_bytes = 0
        self.started = self.said = time.monotonic()
        self.lock = threading.Lock()

    def add(self, size):
        with self.lock:
            self.done_files += 1
            self.done_bytes += size
            now = time.monotonic()
            if now - self.said >= self.every or self.done_files == self.files:
                self.said = now
                print(self.line(now), flush=True)

    def line(self, now):
        seconds = max(now - self.started, 1e-6)
        share = 100 * self.done_bytes / self.total if self.total else 100
        return (
            f"uploading results: {self.done_files}/{self.files} files, {self.done_bytes / 1e6:.1f}/"
            f"{self.total / 1e6:.1f} MB ({share:.0f}%), {self.done_bytes / 1e6 / seconds:.1f} MB/s"
        )


def upload_run(run_dir, container, prefix, exclude=(), threads=UPLOAD_THREADS):
    """Upload the run directory under prefix/, but the relative paths in exclude; returns (files, bytes,
    failures), failures mapping each relative path that did not make it to why.

    The first file goes alone: a refused credential or a missing container fails it, and the whole
    upload, at once. The rest go in parallel, smallest first, so that logs and metrics are up before
    the model's weights when the time runs out (KillWait after a cancel); a file that fails after its
    retries is reported, and the others still go."""
    files = [item for item in files_to_upload(run_dir) if item[1] not in exclude]
    if not files:
        return 0, 0, {}
    first, rest = files[0], sorted(files[1:], key=lambda item: (os.path.getsize(item[0]), item[1]))
    progress = Progress(len(files), sum(os.path.getsize(path) for path, _ in files))
    total = upload_file(container, first[0], f"{prefix}/{first[1]}")
    progress.add(total)
    failures = {}
    local = threading.local()  # a connection per thread: http.client's are not shared

    def one(item):
        path, relative = item
        if not hasattr(local, "container"):
            local.container = container.clone()
        try:
            size = upload_file(local.container, path, f"{prefix}/{relative}")
            progress.add(size)
            return size
        except UploadError as exc:
            if exc.exit_code != EXIT_FAILED:
                raise
            failures[relative] = str(exc)
        except OSError as exc:
            failures[relative] = f"cannot read {relative}: {exc.strerror or exc}"
        return 0

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        total += sum(pool.map(one, rest))
    return len(files) - len(failures), total, failures


def finish_status(path, failures, error=None):
    """Complete the job's status.json (written by job.sh with "results": "uploading") with the truth:
    "uploaded", "incomplete" (with the files in not_uploaded) or "failed" (with results_error)."""
    try:
        with open(path, encoding="utf-8") as handle:
            status = json.load(handle)
    except (OSError, ValueError):
        status = {}
    status["results"] = "failed" if error else "incomplete" if failures else "uploaded"
    status["not_uploaded"] = sorted(failures)
    if error:
        status["results_error"] = error
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as handle:
        json.dump(status, handle)
        handle.write("\n")
    os.replace(temp, path)


# --- command line ------------------------------------------------------------------------------
def blob_prefix(text):
    prefix = text.strip("/")
    parts = prefix.split("/")
    if not prefix or any(p in ("", ".", "..") for p in parts):
        raise argparse.ArgumentTypeError(f"expected a blob name prefix such as a run id, got {text!r}")
    return prefix


def add_container_arguments(parser):
    """--account-url, --container and the credential: what every job tool that reaches the container takes."""
    parser.add_argument("--account-url", required=True, help="the storage account's blob endpoint, no SAS in it")
    parser.add_argument("--container", required=True, help="the container (e.g. results)")
    auth = parser.add_mutually_exclusive_group(required=True)
    auth.add_argument("--sas-file", help="a file whose first line is a SAS on the container")
    auth.add_argument("--managed-identity", action="store_true", help="authenticate with the VM's managed identity")
    parser.add_argument("--client-id", help="with --managed-identity: which user-assigned identity")


def check_container_arguments(parser, args):
    if args.client_id and not args.managed_identity:
        parser.error("--client-id goes with --managed-identity")


def open_container(args):
    """The container of add_container_arguments' flags, with its credential (a SAS, or an IMDS token)."""
    container = Container(args.account_url, args.container)  # checked before IMDS is asked
    if args.sas_file:
        container.sas = read_sas(args.sas_file)
    elif container.endpoint.scheme != "https":
        raise UploadError(
            "--managed-identity needs an https --account-url: a token never goes in clear",
            EXIT_BAD_INPUT,
        )
    else:
        container.token = imds_token(args.client_id)
    return container


def build_parser():
    parser = argparse.ArgumentParser(
        prog="upload_results.py",
        description="Upload a run directory (not its checkpoints, tool copies or *.sas files) to a blob container.",
        epilog="example: python3 upload_results.py --dir /shared/runs/r1 --account-url "
        "https://ACCOUNT.blob.core.windows.net --container results --prefix r1 --managed-identity --client-id ID",
    )
    parser.add_argument("--dir", required=True, help="the run directory")
    parser.add_argument("--prefix", required=True, type=blob_prefix, help="blob names start with PREFIX/ (the run id)")
    add_container_arguments(parser)
    parser.add_argument(
        "--status",
        help="the job's status file, relative to --dir (e.g. status.json): uploaded last, after its "
        '"results" is set to uploaded, incomplete (not_uploaded lists the files) or failed (results_error)',
    )
    parser.add_argument(
        "--with-checkpoints",
        action="store_true",
        help="also the last pass of checkpoint_mirror.py over DIR/checkpoints (what it has not sent yet), "
        "before --status",
    )
    return parser


# Exit codes after which the job's writers have closed every file: success, and 75, a job that saved its
# checkpoint on a warning or an eviction notice and then exited (infra/contract.py PREEMPTED_EXIT_CODE;
# this tool runs on the hosts with the standard library alone).
WRITERS_DONE_EXIT_CODES = (0, 75)


def final_checkpoint_pass(run_dir, container, prefix, status=None):
    """The checkpoint mirror's last pass, in this process (job.sh's time after a cancel is short);
    returns (files, bytes, failures by path in the run directory). Every changed file goes when the
    status file says the job's writers are done (WRITERS_DONE_EXIT_CODES), only complete ones otherwise."""
    from checkpoint_mirror import STATE, Mirror  # beside this file in the run's remote/; it imports this module

    directory = os.path.join(run_dir, CHECKPOINTS)
    state = os.path.join(run_dir, "remote", STATE)  # where job.sh's mirror kept it
    mirror = Mirror(directory, f"{prefix}/{CHECKPOINTS}", lambda: container, state, label="checkpoint ")
    before = dict(mirror.uploaded)
    finished_writing = status is not None and _exit_code(os.path.join(run_dir, status)) in WRITERS_DONE_EXIT_CODES
    failures = mirror.run_pass(every=finished_writing, final=True)
    sent = [name for name, seen in mirror.uploaded.items() if before.get(name) != seen]
    size = sum(mirror.uploaded[name][0] for name in sent)
    return len(sent), size, {f"{CHECKPOINTS}/{name}": why for name, why in failures.items()}


def _exit_code(status_path):
    """The job's exit code in its status file (job.sh writes it before this runs), or None."""
    try:
        with open(status_path, encoding="utf-8") as handle:
            return json.load(handle).get("exit_code")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_container_arguments(parser, args)
    try:
        if not os.path.isdir(args.dir):
            raise UploadError(f"--dir {args.dir} is not a directory", EXIT_BAD_INPUT)
        container = open_container(args)
        exclude = [args.status] if args.status else []
        count, size, failures = upload_run(args.dir, container, args.prefix, exclude=exclude)
        if args.with_checkpoints:
            more, more_size, missed = final_checkpoint_pass(args.dir, container, args.prefix, args.status)
            count, size, failures = count + more, size + more_size, {**failures, **missed}
        if args.status:  # last, and with the truth: what the other files' upload came to
            status = os.path.join(args.dir, args.status)
            finish_status(status, failures)
            try:
                size += upload_file(container, status, f"{args.prefix}/{args.status}")
                count += 1
            except UploadError as exc:
                failures[args.status] = str(exc)
                finish_status(status, failures)
    except UploadError as exc:
        if args.status:
            with contextlib.suppress(OSError):
                finish_status(os.path.join(args.dir, args.status), {}, str(exc))
        print(f"upload_results: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("upload_results: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    for relative, why in sorted(failures.items()):
        print(f"upload_results: error: {relative} not uploaded: {why}", file=sys.stderr)
    print(f"uploaded {count} files ({size / 1e6:.1f} MB) to {container.url}/{args.prefix}/")
    return EXIT_FAILED if failures else 0


if __name__ == "__main__":
    sys.exit(main())
