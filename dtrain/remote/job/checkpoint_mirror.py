#!/usr/bin/env python3
"""checkpoint-mirror: copy a job's $CHECKPOINT_DIR to the results container while the job runs.

Standard library only, Python 3.10+: job.sh starts it in the background on the first node, beside the
launcher, from the run's `remote/` directory (with upload_results.py, whose blob client it uses), and
stops it when the job ends, when upload_results.py --with-checkpoints makes the last pass (as --once
does here, by hand). Any code's checkpoints so reach storage that outlives the cluster
(`launch --resume-from RUN` starts a new run from them), not only our jobs' file names.

  python3 checkpoint_mirror.py --dir RUN_DIR/checkpoints --prefix RUN_ID/checkpoints --state FILE \\
      --account-url URL --container results (--sas-file FILE | --managed-identity [--client-id ID])

Every INTERVAL seconds it lists the directory (the shared file system, where every node's ranks write)
and uploads each regular file that is new or changed since its last upload and complete, whole files
only, to the block blob PREFIX/<blob name>. A file is complete when its writer says so, by renaming it
into place (write `.name.tmp`, then rename it to `name`: the rename leaves its change time after its
last write, ctime > mtime), or when it has not been written for QUIET_S seconds: a writer that pauses
longer than a scan does not get a torn file uploaded. Names starting with `.` (a file or a directory on
the way) are temporary by convention, ours included, and never copied. Symbolic links are never
followed: a link inside DIR is skipped, and a DIR that is itself a link is not mirrored (its target
is not the job's to copy: a dataset, another run), each said once. What was uploaded is remembered in
--state FILE, so that the last pass and a requeued attempt send only what is new. The last pass, at the
job's end, takes every file as complete when the job's writers are done (it succeeded, or exited 75 after
saving its checkpoint on a warning or a notice: upload_results.py), and otherwise those renamed into
place or unwritten for FINAL_QUIET_S before the pass (the job's processes have been stopped by then): a
file a killed writer left half written is named, not uploaded. Files
deleted from DIR stay in the container (a run's older checkpoints, for a resume from before).

Blob names keep a file's name byte for byte: bytes other than letters, digits, `_.~-` and `/` are
written %XX, and so is a dot that ends a part, because the service would alter them (`\\` turns into
`/`, a trailing dot is dropped); fetch_checkpoint.py decodes them. Our jobs' names are all plain.

Why our own, and not azcopy sync or inotify: azcopy is on the HPC image (Azure/azhpc-images
components/install_azcopy.sh) but not on the local cluster, and `azcopy sync` copies whatever a
directory holds when it runs, a checkpoint still being written included (it has no notion of a file
being complete); inotify sees only this node's writes to a shared file system, not other nodes'. This
needs the node's bare python3 and the blob client the job's results upload already uses.

Exit status (--once): 0 all uploaded; 1 some files failed (each is named on stderr, with why: access
refused, storage unreachable); 2 bad arguments. Without --once it runs until SIGTERM, which ends it
after the upload in progress; a file that failed is tried again at the next scan.
"""

import argparse
import json
import os
import signal
import stat
import sys
import time
import urllib.parse

from upload_results import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    UploadError,
    add_container_arguments,
    blob_prefix,
    check_container_arguments,
    open_container,
    upload_file,
)

# relative path -> [size, mtime_ns] of its last upload; in the run's remote/ directory (job.sh's --state), not
# in the job's own checkpoint directory, which its code may list
STATE = "checkpoints-mirrored.json"
INTERVAL_S = 10.0
QUIET_S = 120  # a file not renamed into place is complete once unwritten this long (docs/operator.md)
# At the last pass the job's processes have been stopped (job.sh gives the step 10 s after a TERM): a
# file unwritten for this long before it was finished with before the end came; one written in the
# last seconds may have been cut off. A rename within the same clock tick as the last write leaves
# ctime == mtime, so the quiet span, not the rename, is what keeps such a file (ours: ckpt-*.ckpt).
FINAL_QUIET_S = 15
TOKEN_TTL_S = 1800  # an IMDS token lasts hours; take a new one well before
LABEL = "[job] checkpoint mirror: "  # its lines in output.log (job.sh does not pipe it through sed)


def blob_name(relative):
    """The blob name that keeps a relative path's bytes: each part %XX-encoded but for letters, digits and
    `_.~-`, and a part's last dot too (the service would turn `\\` into `/` and drop a trailing dot)."""
    parts = []
    for part in os.fsencode(relative).split(b"/"):
        quoted = urllib.parse.quote(part, safe="")
        parts.append(quoted[:-1] + "%2E" if quoted.endswith(".") else quoted)
    return "/".join(parts)


def relative_name(blob):
    """blob_name's inverse: the relative path, with the file system's bytes (surrogate-escaped)."""
    return os.fsdecode(urllib.parse.unquote_to_bytes(blob))


def scan(directory, skipped):
    """{relative POSIX path: (size, mtime_ns, ctime_ns)} of the regular files under directory, but temporary
    ones; symbolic links are not followed, and skipped(relative path) hears of each."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            skipped(os.path.relpath(os.path.join(root, name), directory))
        dirs[:] = [d for d in dirs if not d.startswith(".") and not os.path.islink(os.path.join(root, d))]
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue  # renamed or deleted meanwhile
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            if stat.S_ISLNK(info.st_mode):
                skipped(relative)
            elif stat.S_ISREG(info.st_mode):
                found[relative] = (info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return found


def load_state(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return {name: tuple(seen) for name, seen in json.load(handle).items()}
    except (OSError, ValueError, TypeError):
        return {}


def save_state(path, state):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
        json.dump(state, handle)
    os.replace(f"{path}.tmp", path)


class Mirror:
    """What was uploaded and what has been said; one pass uploads the complete files that are due."""

    def __init__(self, directory, prefix, connect, state, label=LABEL, clock=time.time):
        self.directory, self.prefix, self.connect, self.label = directory, prefix, connect, label
        self.state, self.clock = state, clock
        self.uploaded = load_state(state)  # relative path -> [size, mtime_ns] of its upload
        self.said = set()  # what was skipped, said once each
        self.container, self.connected_at = None, 0.0

    def changed(self, now):
        """The scanned files (relative path -> (size, mtime_ns, ctime_ns)) new or changed since their upload."""
        return {name: info for name, info in now.items() if self.uploaded.get(name) != info[:2]}

    def complete(self, info, quiet_s=QUIET_S):
        """Renamed into place after its last write (ctime > mtime), or unwritten for quiet_s seconds."""
        _, mtime_ns, ctime_ns = info
        return ctime_ns > mtime_ns or self.clock() - mtime_ns / 1e9 >= quiet_s

    def run_pass(self, every=False, stopping=(), final=False):
        """Scan, upload what is due (until stopping is true); returns {relative path: why} for the files
        that failed. final: the job's last pass, which names the incomplete files among the failures
        (every: the job succeeded, so its writers closed every file)."""
        if os.path.islink(self.directory):
            self.say_once(".", f"{self.directory} is a symbolic link, to {os.path.realpath(self.directory)}: not "
                          "mirrored (write checkpoints into $CHECKPOINT_DIR itself)")  # fmt: skip
            return {}
        now = scan(self.directory, self.skip_link) if os.path.isdir(self.directory) else {}
        changed = self.changed(now)
        quiet_s = FINAL_QUIET_S if final else QUIET_S
        due = {name: info for name, info in changed.items() if every or self.complete(info, quiet_s)}
        failures = {name: self.incomplete(info) for name, info in changed.items() if final and name not in due}
        for name, info in sorted(due.items()):
            if stopping:
                break
            try:
                blob = f"{self.prefix}/{blob_name(name)}"
                size = upload_file(self._container(), os.path.join(self.directory, name), blob)
            except UploadError as exc:
                failures[name] = str(exc)
                self.container = None  # a new credential next time (an expired token)
                continue
            except OSError as exc:  # deleted meanwhile
                failures[name] = f"cannot read it: {exc.strerror or exc}"
                continue
            self.uploaded[name] = info[:2]
            save_state(self.state, self.uploaded)
            print(f"{self.label}{name} ({size / 1e6:.1f} MB) is in the results container", flush=True)
        return failures

    def incomplete(self, info):
        quiet = self.clock() - info[1] / 1e9
        return (
            f"last written {quiet:.0f} s before the job ended and not renamed into place: it may be torn "
            f"(write .NAME.tmp, then rename it; docs/operator.md)"
        )

    def skip_link(self, relative):
        self.say_once(relative, f"{relative} skipped: a symbolic link (only files written in the directory go)")

    def say_once(self, key, line):
        if key not in self.said:
            self.said.add(key)
            print(f"{self.label}{line}", flush=True)

    def _container(self):
        if self.container is None or time.monotonic() - self.connected_at > TOKEN_TTL_S:
            self.container, self.connected_at = self.connect(), time.monotonic()
        return self.container


def build_parser():
    parser = argparse.ArgumentParser(
        prog="checkpoint_mirror.py",
        description="Upload the complete files of a checkpoint directory to a blob container as they appear.",
    )
    parser.add_argument("--dir", required=True, help="the job's checkpoint directory ($CHECKPOINT_DIR)")
    parser.add_argument("--prefix", required=True, type=blob_prefix, help="blob names start with PREFIX/")
    parser.add_argument("--state", required=True, help=f"where it remembers what it sent (job.sh: remote/{STATE})")
    add_container_arguments(parser)
    parser.add_argument("--interval", type=float, default=INTERVAL_S, help="seconds between scans (default 10)")
    parser.add_argument("--once", action="store_true", help="one pass that uploads every new file, then exit")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_container_arguments(parser, args)
    if args.interval <= 0:
        parser.error("--interval must be above 0")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    mirror = Mirror(args.dir, args.prefix, lambda: open_container(args), args.state)
    try:
        if args.once:
            failures = mirror.run_pass(every=True)
            for name, why in sorted(failures.items()):
                print(f"checkpoint_mirror: error: {name} not uploaded: {why}", file=sys.stderr)
            return EXIT_FAILED if failures else 0
        while not stopping:
            for name, why in mirror.run_pass(stopping=stopping).items():
                print(f"{LABEL}{name} not uploaded yet: {why}", flush=True)
            deadline = time.monotonic() + args.interval
            while not stopping and time.monotonic() < deadline:
                time.sleep(min(0.2, args.interval))  # job.sh's finish() waits for it to stop
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
