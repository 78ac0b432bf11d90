#!/usr/bin/env python3
"""fetch-checkpoint: `launch --resume-from RUN`, cluster side: RUN's kept checkpoint from the results
container into this job's $CHECKPOINT_DIR, before the job's command starts.

Standard library only, Python 3.10+: job.sh runs it on the first node from the run's `remote/`
directory, with the blob client and credential of upload_results.py (the run's SAS file locally; on
Azure the nodes' managed identity, whose role on the results container reads it): the checkpoint goes
from storage to the shared file system directly, never through the operator's machine.

  python3 fetch_checkpoint.py --run RUN --dest "$CHECKPOINT_DIR" --account-url URL --container results \\
      (--sas-file FILE | --managed-identity [--client-id ID])

What it fetches, from the blobs RUN/checkpoints/... (checkpoint_mirror.py put them there):
  - our jobs' checkpoints (ckpt-<step>.ckpt, or a model-parallel step-<step>/ directory): the newest
    one only, which is what they resume from;
  - anything else (the user's own code's files): every file, at its relative path.
Each file is read in 64 MiB ranges to a hidden temporary name, checked against the blob's MD5, then
renamed into place. The last line on stdout: `fetched N files (X MB) of RUN's checkpoints into DEST`.

Exit status: 0 fetched; 1 the storage service failed or a file did not match its MD5; 2 bad arguments,
or RUN kept no checkpoint; 3 access refused or storage unreachable; 130 interrupted.
"""

import argparse
import base64
import hashlib
import os
import re
import sys
import urllib.parse
import xml.etree.ElementTree as ET

from checkpoint_mirror import relative_name
from upload_results import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_READY,
    UploadError,
    add_container_arguments,
    blob_prefix,
    check_container_arguments,
    error_code,
    open_container,
)

RANGE = 64 * 1024 * 1024
OURS = re.compile(r"^(?:ckpt-(\d{10})\.ckpt|step-(\d{10})/[^/]+)$")  # training/checkpoint's names


def refused(what, status, data):
    code = error_code(data)
    text = f"{what}: HTTP {status}" + (f" {code}" if code else "")
    if status in (401, 403):
        return UploadError(f"{text}: the credential cannot read the results container", EXIT_NOT_READY)
    return UploadError(text, EXIT_FAILED if status >= 500 else EXIT_BAD_INPUT)


def list_blobs(container, prefix):
    """[(name, size, md5 base64 or None)] of every blob under prefix, all pages."""
    found, marker = [], ""
    while True:
        query = {"restype": "container", "comp": "list", "prefix": prefix, "maxresults": "5000"}
        if marker:
            query["marker"] = marker
        status, data = container.send("GET", None, urllib.parse.urlencode(query), {})
        if status != 200:
            raise refused(f"cannot list {container.url}/{prefix}", status, data)
        root = ET.fromstring(data)
        for blob in root.iter("Blob"):
            props = blob.find("Properties")
            size = int(props.findtext("Content-Length") or 0)
            found.append((blob.findtext("Name"), size, props.findtext("Content-MD5") or None))
        marker = (root.findtext("NextMarker") or "").strip()
        if not marker:
            return found


def choose(relative_names):
    """The names to fetch: the newest of our checkpoints where the run kept ours, else every file."""
    steps = {}
    for name in relative_names:
        match = OURS.match(name)
        if match:
            steps.setdefault(int(match.group(1) or match.group(2)), []).append(name)
    return sorted(steps[max(steps)]) if steps else sorted(relative_names)


def download(container, blob, size, md5, target):
    """blob -> target, in ranges, through a hidden temporary file; checked against md5 where known."""
    directory, name = os.path.split(target)
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{name}.fetching")
    digest = hashlib.md5()
    with open(temp, "wb") as handle:
        for start in range(0, size, RANGE):
            end = min(start + RANGE, size) - 1
            status, data = container.send("GET", blob, "", {"x-ms-range": f"bytes={start}-{end}"})
            if status not in (200, 206):
                raise refused(f"cannot read {blob}", status, data)
            digest.update(data)
            handle.write(data)
    got = base64.b64encode(digest.digest()).decode("ascii")
    if md5 and got != md5:
        os.remove(temp)
        raise UploadError(f"{blob}: the download does not match the blob's MD5 ({got}, not {md5})", EXIT_FAILED)
    os.replace(temp, target)


def fetch(container, run, dest):
    """Fetch run's checkpoint into dest; returns (files, bytes)."""
    prefix = f"{run}/checkpoints/"
    # the names as the files had them (checkpoint_mirror.py encodes what the service would alter)
    blobs = {relative_name(name[len(prefix) :]): (name, size, md5) for name, size, md5 in list_blobs(container, prefix)}
    if not blobs:
        raise UploadError(f"{container.url} holds no checkpoint of run {run} (nothing under {prefix})", EXIT_BAD_INPUT)
    chosen = choose(blobs)
    total = 0
    for relative in chosen:
        parts = relative.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise UploadError(f"refusing blob {prefix}{relative}: it would land outside {dest}", EXIT_BAD_INPUT)
        name, size, md5 = blobs[relative]
        download(container, name, size, md5, os.path.join(dest, *parts))
        total += size
    return len(chosen), total


def build_parser():
    parser = argparse.ArgumentParser(
        prog="fetch_checkpoint.py", description="Fetch a run's kept checkpoint from the results container."
    )
    parser.add_argument("--run", required=True, type=blob_prefix, help="the run whose checkpoint to fetch")
    parser.add_argument("--dest", required=True, help="the new job's checkpoint directory ($CHECKPOINT_DIR)")
    add_container_arguments(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_container_arguments(parser, args)
    try:
        count, size = fetch(open_container(args), args.run, args.dest)
    except UploadError as exc:
        print(f"fetch_checkpoint: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"fetch_checkpoint: error: cannot write to {args.dest}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_READY
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    print(f"fetched {count} files ({size / 1e6:.1f} MB) of {args.run}'s checkpoints into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
