#!/usr/bin/env python3
"""nvme-copy: copy a dataset from the shared file system to this node's local NVMe, verified.

Standard library only (the nodes' python3). One run per node:

  nvme_copy.py --source /shared/data/imagenet --dest /nvme/data/imagenet

Files are copied in parallel (threads: NFS wants many requests in flight), each written under a
temporary name and renamed into place, and hashed (SHA-256) on the way. A journal in DEST records
every file once it is in place, so a run that was killed resumes: a file is copied again only when
it is missing from the journal or its size differs from the source's. Then every file of the source
listing is verified: its size, and the SHA-256 of the local copy against the one taken while copying
it. A file that fails is copied again, once. Only when all pass is the completion marker written
(last), with the file count and total bytes; a later run verifies again and copies nothing.

The last line on stdout is a JSON summary: files, bytes, copied, skipped, recopied, failed.
Exit status: 0 complete and verified; 1 some files failed verification; 2 bad arguments; 130
interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CHUNK = 4 * 1024 * 1024
JOURNAL = ".copy-journal.jsonl"
MARKER = ".copy-complete.json"
TMP_SUFFIX = ".nvme-copy-tmp"
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the source (and the destination)
    size: int


def listing(source: str) -> list[Entry]:
    """Every regular file under source, in a stable order."""
    entries = []
    for root, dirs, files in os.walk(source):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            if os.path.isfile(full):
                entries.append(Entry(os.path.relpath(full, source), os.path.getsize(full)))
    return entries


def remove_leftovers(dest: str) -> None:
    """Temporary files of a killed run: never mistaken for data by whoever reads dest."""
    for root, _, files in os.walk(dest):
        for name in files:
            if name.endswith(TMP_SUFFIX):
                os.remove(os.path.join(root, name))


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Journal:
    """What is in place: relative path -> (size, sha256), appended one line per file."""

    def __init__(self, dest: str):
        self.path = os.path.join(dest, JOURNAL)
        self.lock = threading.Lock()
        self.done: dict[str, tuple[int, str]] = {}
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as handle:
                for line in handle:
                    try:
                        record = json.loads(line)
                    except ValueError:  # the torn last line of a killed run
                        continue
                    self.done[record["path"]] = (record["size"], record["sha256"])

    def add(self, entry: Entry, sha256: str) -> None:
        with self.lock, open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"path": entry.path, "size": entry.size, "sha256": sha256}) + "\n")
            handle.flush()
            self.done[entry.path] = (entry.size, sha256)


def copy_one(source: str, dest: str, entry: Entry, journal: Journal) -> None:
    target = os.path.join(dest, entry.path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = target + TMP_SUFFIX
    digest = hashlib.sha256()
    with open(os.path.join(source, entry.path), "rb") as reader, open(temporary, "wb") as writer:
        while chunk := reader.read(CHUNK):
            digest.update(chunk)
            writer.write(chunk)
    os.replace(temporary, target)
    journal.add(entry, digest.hexdigest())


def in_place(dest: str, entry: Entry, journal: Journal) -> bool:
    """Copied by this or an earlier run, and the local file still has the source's size."""
    target = os.path.join(dest, entry.path)
    return journal.done.get(entry.path, (-1, ""))[0] == entry.size and (
        os.path.isfile(target) and os.path.getsize(target) == entry.size
    )


def verified(dest: str, entry: Entry, journal: Journal) -> bool:
    target = os.path.join(dest, entry.path)
    if not in_place(dest, entry, journal):
        return False
    return sha256_of(target) == journal.done[entry.path][1]


def copy_all(source: str, dest: str, entries: list[Entry], journal: Journal, workers: int) -> list[Entry]:
    """Copies what is not in place yet; returns what it copied."""
    todo = [entry for entry in entries if not in_place(dest, entry, journal)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(copy_one, source, dest, entry, journal) for entry in todo]:
            future.result()
    return todo


def verify_all(dest: str, entries: list[Entry], journal: Journal, workers: int) -> list[Entry]:
    """The entries whose local copy does not match its size and hash."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda entry: verified(dest, entry, journal), entries))
    return [entry for entry, ok in zip(entries, results, strict=True) if not ok]


def write_marker(dest: str, source: str, entries: list[Entry]) -> None:
    marker = os.path.join(dest, MARKER)
    record = {"source": source, "files": len(entries), "bytes": sum(entry.size for entry in entries)}
    with open(marker + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(marker + ".tmp", marker)


def run(source: str, dest: str, workers: int) -> dict[str, int]:
    entries = listing(source)
    os.makedirs(dest, exist_ok=True)
    # A run that copies or repairs anything says "incomplete" until it has verified everything.
    if os.path.exists(os.path.join(dest, MARKER)):
        os.remove(os.path.join(dest, MARKER))
    remove_leftovers(dest)
    journal = Journal(dest)
    copied = copy_all(source, dest, entries, journal, workers)
    bad = verify_all(dest, entries, journal, workers)
    for entry in bad:
        journal.done.pop(entry.path, None)
    recopied = copy_all(source, dest, bad, journal, workers)
    failed = verify_all(dest, bad, journal, workers)
    summary = {
        "files": len(entries),
        "bytes": sum(entry.size for entry in entries),
        "copied": len(copied),
        "skipped": len(entries) - len(copied),
        "recopied": len(recopied),
        "failed": len(failed),
    }
    for entry in failed:
        print(f"nvme-copy: {entry.path} does not verify after a second copy", file=sys.stderr)
    if not failed:
        write_marker(dest, source, entries)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--source", required=True, help="the dataset's directory on the shared file system")
    parser.add_argument("--dest", required=True, help="where to copy it on local storage")
    parser.add_argument("--workers", type=int, default=16, help="files copied at once (default 16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    source, dest = os.path.abspath(args.source), os.path.abspath(args.dest)
    if not os.path.isdir(source):
        print(json.dumps({"error": f"--source {source} is not a directory"}))
        return EXIT_BAD_INPUT
    if args.workers < 1 or dest == source or dest.startswith(source + os.sep):
        print(json.dumps({"error": "--workers must be 1 or more, and --dest outside --source"}))
        return EXIT_BAD_INPUT
    try:
        summary = run(source, dest, args.workers)
    except KeyboardInterrupt:
        print(json.dumps({"error": "interrupted"}))
        return EXIT_INTERRUPTED
    print(json.dumps(summary))
    return EXIT_FAILED if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
