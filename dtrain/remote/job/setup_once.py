#!/usr/bin/env python3
"""setup-once: run a task's `setup` on this node unless it already ran here for the same code and setup.
Runs on every node of a job (one task per node, started by job.sh with srun), with the node's python3
(stdlib only), from the run's `remote/` directory.

  setup_once.py --code RUN/code --setup RUN/setup.sh --cache-dir DIR [--salt IMAGE] -- COMMAND...

The key is a SHA-256 of the code directory's files (paths and contents), the setup text and the salt
(the image, on the docker runtime). After COMMAND succeeds, DIR/<host>/<user>/<key>/done is written;
a later job with the same key skips COMMAND and says so. DIR is on the node's own disk (the host is in
the path for clusters whose nodes share one, like the local cluster), so a node that was reimaged or
replaced runs setup again. Where DIR cannot be made, setup runs every time, with a notice.

Exit status: COMMAND's; 0 when skipped. On failure it prints `error: setup failed on HOST ...` and
writes RUN_DIR/verdict.json with that error (first node to fail wins), so that `launch` names setup.
"""

import argparse
import getpass
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

READ_CHUNK = 1 << 20


def code_key(code_dir, setup_file, salt):
    """What setup depends on: every file of the code (path and bytes), the setup text, the salt."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(code_dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, code_dir).encode() + b"\0")
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as handle:
                while chunk := handle.read(READ_CHUNK):
                    digest.update(chunk)
            digest.update(b"\0")
    with open(setup_file, "rb") as handle:
        digest.update(b"setup\0" + handle.read() + b"\0" + salt.encode())
    return digest.hexdigest()[:16]


def marker_dir(cache_dir, key):
    """DIR/<host>/<user>/<key>, made (0700) if it can be; None where it cannot."""
    path = os.path.join(cache_dir, socket.gethostname(), getpass.getuser(), key)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path


def record_failure(run_dir, message):
    """The job's verdict names setup: the first node to fail writes it (O_EXCL)."""
    verdict = {"failed_rank": None, "failed_host": socket.gethostname(), "exit_code_of_failed_rank": None}
    verdict["job_error"] = message
    try:
        fd = os.open(os.path.join(run_dir, "verdict.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(verdict, handle, indent=2)
        handle.write("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="setup_once.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", required=True, help="the run's code directory")
    parser.add_argument("--setup", required=True, help="the setup script (what the key hashes with the code)")
    parser.add_argument("--cache-dir", required=True, help="on the node's own disk: where markers are kept")
    parser.add_argument("--salt", default="", help="more that setup depends on (the image)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command that runs setup")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    host = socket.gethostname()
    key = code_key(args.code, args.setup, args.salt)
    marker = marker_dir(args.cache_dir, key)
    if marker and os.path.exists(os.path.join(marker, "done")):
        print(f"[setup] {host}: skipped, done before for this code and setup (key {key})", flush=True)
        return 0
    if marker is None:
        print(f"[setup] {host}: cannot write to {args.cache_dir}: setup runs every time", flush=True)
    print(f"[setup] {host}: running setup (key {key})", flush=True)
    started = time.monotonic()
    code = subprocess.call(command, cwd=args.code)
    if code != 0:
        message = f"setup failed on {host} (exit status {code}): see the [setup] lines of the log; run not started"
        print(f"error: {message}", flush=True)
        record_failure(os.path.dirname(os.path.abspath(args.setup)), message)
        return code if 0 < code < 256 else 1
    if marker:
        with open(os.path.join(marker, "done"), "w", encoding="utf-8") as handle:
            handle.write(time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime()))
    print(f"[setup] {host}: done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
