#!/usr/bin/env python3
"""annotate-output: turn a launcher's merged output into the job's log, one log per rank, and a verdict.

Standard library only, Python 3.10+: the batch script (job.sh) runs it on the first node of the
allocation, with the node's python3, from the run's `remote/` directory:

  horovodrun ... 2>&1 | python3 annotate_output.py --launcher horovodrun --hosts node-0,node-1 --slots 2 \\
      --logs-dir RUN/logs --verdict RUN/verdict.json [--secrets RUN/secrets/env]

Every input line goes to stdout (the job's output.log), flushed line by line, nothing dropped:

  [3|node-1] text        rank 3's stdout (rank 3 runs on node-1)
  [3|node-1]! text       rank 3's stderr (horovodrun only: torchrun does not tell the streams apart)
  [horovodrun] text      the launcher's own lines (or [torchrun] ..., srun's lines)
  [torchrun@node-1] text torchrun's own lines on node-1 (its agent's log, its failure summary)

With --secrets, the values of the run's secrets are replaced by `***` in each line before anything else
reads it (job_secrets.py, beside this file). Each rank's own text is also appended to LOGS_DIR/rank-N.log.
At end of input the verdict is written (atomically) as JSON: failed_rank, failed_host,
exit_code_of_failed_rank (null when no rank failed) and job_error (the first rank line that starts with
`error: `, which training/run/job.py prints). A launcher names the rank that exited first, which after a
peer died or froze is the healthy rank that noticed; when job_error names the culprit (`rank N on host H
stopped answering|has exited|is unreachable`, training/world/liveness.py), failed_rank and failed_host are
the culprit's, and exit_code_of_failed_rank stays the status the launcher reported for the failure (the
job's).

horovodrun (--gloo): rank lines are `[RANK]<stdout|stderr>:text`, with an optional time.asctime()
stamp in front; it assigns ranks host by host, SLOTS per host, in hostfile order (--hosts order).
A failed rank shows as `Process N exit with status code X.`, the first one in the closing
`Process name: N` / `Exit code: X` block.

torchrun, one per node under `srun --label --ntasks-per-node=1 ...`: srun puts `N: ` (the task id,
zero-padded to the width of the largest; one task per node, so the node's index in --hosts) in front
of every line, and torchrun must run with `--tee 3` and the environment variable
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='@rank${rank}@' (TORCHRUN_PREFIX_TEMPLATE) so that each rank's
line carries its global rank: torchrun's default prefix, `[default0]:`, is the local rank, and the c10d
rendezvous numbers nodes in its own order, not srun's; and PyTorch itself writes `[rank0]: ` in front
of the lines of a rank's traceback, so the template must not look like that. The first failure summary's
`Root Cause` block (`rank : N (local_rank: L)`, `exitcode : X`) names the failed rank; failing that,
srun's `srun: error: HOST: task T: Exited with exit code X` names the host.

SIGINT and SIGTERM are ignored: on scancel Slurm signals every process of the batch step, and the
log must keep the launcher's last words; the launcher's end (end of input) ends this too.
Exit status: 0; 1 when the log or the verdict cannot be written; 2 bad arguments.
"""

import argparse
import json
import os
import re
import signal
import sys

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
LAUNCHERS = ("horovodrun", "torchrun")
# What job.sh exports as TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE for torchrun (see above).
TORCHRUN_PREFIX_TEMPLATE = "@rank${rank}@"
HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

_HOROVOD_RANK = re.compile(r"^(?:[A-Z][a-z]{2} [A-Z][a-z]{2} +\d+ [\d:]+ \d{4})?\[(\d+)\]<(stdout|stderr)>:(.*)$")
_HOROVOD_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_HOROVOD_FIRST_RANK = re.compile(r"^Process name: (\d+)\s*$")
_HOROVOD_FIRST_CODE = re.compile(r"^Exit code: (-?\d+)\s*$")
_SRUN_LABEL = re.compile(r"^(\d+): (.*)$")
_TORCHRUN_RANK = re.compile(re.escape(TORCHRUN_PREFIX_TEMPLATE).replace(re.escape("${rank}"), r"(\d+)"))
_TORCHRUN_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)")
# training/world/liveness.py's words for a peer that died, froze or was cut off, at the start of job_error
_CULPRIT = re.compile(r"^rank (\d+) on host (\S+) (?:stopped answering|has exited|is unreachable)")
_SRUN_TASK_EXIT = re.compile(r"^srun: error: (\S+): tasks? [\d,-]+: Exited with exit code (\d+)")
# The launcher's own crash, as Python's last traceback line says it: a command it could not start
# (FileNotFoundError: [Errno 2] ... 'nosuchprog'), for example. Its summary of failed workers is not one.
_LAUNCHER_EXCEPTION = re.compile(r"^(?!\S*ChildFailedError)[A-Za-z_][\w.]*(?:Error|Exception): \S.*$")


class Line:
    """One line of output and who wrote it: a rank (with its host), a launcher on a host, or the launcher."""

    __slots__ = ("host", "rank", "stderr", "text")

    def __init__(self, text, rank=None, host=None, stderr=False):
        self.text = text
        self.rank = rank
        self.host = host
        self.stderr = stderr

    def render(self, launcher):
        if self.rank is not None:
            return f"[{self.rank}|{self.host}]{'!' if self.stderr else ''} {self.text}"
        if self.host is not None:
            return f"[{launcher}@{self.host}] {self.text}"
        return f"[{launcher}] {self.text}"


def normalize_exit(code):
    """A process's exit code as a shell reports it: -N (killed by signal N) is 128+N, 0-255 kept."""
    if code is None:
        return 1
    if code < 0:
        return 128 + (-code)
    return code if 0 < code < 256 else (1 if code else 0)


class Verdict:
    """Which rank failed first, with what exit code, and the job's own error line."""

    def __init__(self):
        self.first = None  # (rank, host, code) as the launcher's closing summary names it
        self.exits = []  # (rank or None, host, code) in the order the launcher reported them
        self.job_error = None
        self.launcher_error = None  # a launcher's own `error:` line: the reason when no rank gave one

    def rank_line(self, text):
        if self.job_error is None and text.startswith("error: "):
            self.job_error = text[len("error: ") :]

    def launcher_line(self, text):
        if self.launcher_error is None and text.startswith("error: "):
            self.launcher_error = text[len("error: ") :]
        elif self.launcher_error is None and _LAUNCHER_EXCEPTION.match(text):
            self.launcher_error = text

    def as_dict(self):
        rank, host, code = self.first or (self.exits[0] if self.exits else (None, None, None))
        job_error = self.job_error or self.launcher_error
        culprit = _CULPRIT.match(job_error or "")
        if culprit and code is not None:
            rank, host = int(culprit.group(1)), culprit.group(2)
        return {
            "failed_rank": rank,
            "failed_host": host,
            "exit_code_of_failed_rank": None if code is None else normalize_exit(code),
            "job_error": job_error,
        }


class HorovodrunOutput:
    """horovodrun's output: `[rank]<stream>:text` lines and its own."""

    name = "horovodrun"

    def __init__(self, hosts, slots, verdict):
        self.hosts_by_rank = [host for host in hosts for _ in range(slots)]
        self.verdict = verdict
        self.pending_first = None  # the rank of a `Process name:` line, until its `Exit code:` line

    def host_of(self, rank):
        return self.hosts_by_rank[rank] if rank < len(self.hosts_by_rank) else "?"

    def parse(self, text):
        # horovodrun also ends a piece of a rank's output at a carriage return, and prefixes each piece
        return [self._piece(piece) for piece in carriage_pieces(text)]

    def _piece(self, text):
        m = _HOROVOD_RANK.match(text)
        if m:
            rank, body = int(m.group(1)), m.group(3)
            self.verdict.rank_line(body)
            return Line(body, rank, self.host_of(rank), m.group(2) == "stderr")
        if m := _HOROVOD_EXIT.match(text):
            rank = int(m.group(1))
            self.verdict.exits.append((rank, self.host_of(rank), int(m.group(2))))
        elif m := _HOROVOD_FIRST_RANK.match(text):
            self.pending_first = int(m.group(1))
        elif (m := _HOROVOD_FIRST_CODE.match(text)) and self.pending_first is not None:
            if self.verdict.first is None:
                rank = self.pending_first
                self.verdict.first = (rank, self.host_of(rank), int(m.group(1)))
            self.pending_first = None
        else:
            self.verdict.launcher_line(text)
        return Line(text)


class TorchrunOutput:
    """`srun --label` output of one torchrun per node: `N: @rankR@text` and torchrun's own `N: text`."""

    name = "torchrun"

    def __init__(self, hosts, slots, verdict):
        self.hosts = hosts
        self.verdict = verdict
        self.root_cause = {}  # node index -> fields read so far inside its `Root Cause` block

    def parse(self, text):
        m = _SRUN_LABEL.match(text)
        if not m:  # srun's own lines, or the batch script's
            if e := _SRUN_TASK_EXIT.match(text):
                self.verdict.exits.append((None, e.group(1), int(e.group(2))))
            return [Line(piece) for piece in carriage_pieces(text)]
        node, body = int(m.group(1)), m.group(2)
        host = self.hosts[node] if node < len(self.hosts) else "?"
        if not _TORCHRUN_RANK.match(body):
            lines = [Line(piece, host=host) for piece in carriage_pieces(body)]
            for line in lines:
                self.verdict.launcher_line(line.text)
                self._summary_line(node, host, line.text)
            return lines
        # A rank's last words without a newline run into the next rank's line: split at each prefix.
        parts = _TORCHRUN_RANK.split(body)[1:]  # [rank, text, rank, text, ...]
        lines = []
        for rank_text, text_of_rank in zip(parts[::2], parts[1::2], strict=True):
            for piece in carriage_pieces(text_of_rank):
                self.verdict.rank_line(piece)
                lines.append(Line(piece, int(rank_text), host))
        return lines

    def _summary_line(self, node, host, text):
        """Follow torchrun's failure summary: its `Root Cause` block names the rank that failed first."""
        fields = self.root_cause.get(node)
        if text.startswith("Root Cause"):
            self.root_cause[node] = {}
        elif fields is not None:
            if m := _TORCHRUN_FIELD.match(text):
                fields[m.group(1)] = int(m.group(2))
            if text.startswith("=") or len(fields) == 2:
                del self.root_cause[node]
                if len(fields) == 2 and self.verdict.first is None:
                    self.verdict.first = (fields["rank"], host, fields["exitcode"])


def carriage_pieces(text):
    """The pieces of a line that carriage returns separate (progress bars): each is a line of the log."""
    return [piece for piece in text.split("\r") if piece] or [""]


class RankLogs:
    """LOGS_DIR/rank-N.log, opened on a rank's first line, appended to (a requeued attempt adds)."""

    def __init__(self, directory):
        self.directory = directory
        self.files = {}

    def write(self, rank, text):
        handle = self.files.get(rank)
        if handle is None:
            path = os.path.join(self.directory, f"rank-{rank}.log")
            handle = self.files[rank] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        handle.write(text + "\n")

    def close(self):
        for handle in self.files.values():
            handle.close()


def annotate(stream, out, output, logs, mask):
    """Read every line of stream (binary), write it annotated to out, and each rank's text to logs.
    mask (bytes -> bytes) hides the secrets in a line first, so that no log nor the verdict holds
    them. Undecodable bytes are replaced rather than lost."""
    for raw in stream:
        for line in output.parse(mask(raw).decode("utf-8", "replace").rstrip("\n")):
            out.write(line.render(output.name) + "\n")
            out.flush()
            if line.rank is not None:
                logs.write(line.rank, line.text)


def write_json(path, data):
    """Write data as JSON at path atomically: a reader sees the old file or the whole new one."""
    temp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temp, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.replace(temp, path)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None


def host_list(text):
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts or not all(HOSTNAME.fullmatch(h) for h in hosts):
        raise argparse.ArgumentTypeError(f"expected host names separated by commas, got {text!r}")
    return hosts


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="annotate_output.py",
        description="Annotate a launcher's merged output with rank and host, write a log per rank and the verdict.",
        epilog="example: horovodrun ... 2>&1 | python3 annotate_output.py --launcher horovodrun "
        "--hosts node-0,node-1 --slots 2 --logs-dir RUN/logs --verdict RUN/verdict.json",
    )
    parser.add_argument("--launcher", required=True, choices=LAUNCHERS, help="who wrote the input")
    parser.add_argument("--hosts", required=True, type=host_list, help="the nodes, in hostfile / allocation order")
    parser.add_argument("--slots", required=True, type=positive_int, help="processes (ranks) per node")
    parser.add_argument("--logs-dir", required=True, help="where rank-N.log files go (created if missing)")
    parser.add_argument("--verdict", required=True, help="the JSON file written at end of input")
    parser.add_argument("--secrets", help="the run's secrets file: its values are masked (job_secrets.py)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # beside this file in the run's remote/; imported here because the operator's package imports this
    # module too (batch_script.py), where job_secrets is not a top-level module
    from job_secrets import SecretMask, read_secrets

    mask = SecretMask(read_secrets(args.secrets).values() if args.secrets else ())
    verdict = Verdict()
    kind = HorovodrunOutput if args.launcher == "horovodrun" else TorchrunOutput
    try:
        os.makedirs(args.logs_dir, exist_ok=True)
        logs = RankLogs(args.logs_dir)
        try:
            annotate(sys.stdin.buffer, sys.stdout, kind(args.hosts, args.slots, verdict), logs, mask)
        finally:
            logs.close()
            write_json(args.verdict, verdict.as_dict())
    except OSError as exc:
        print(f"annotate_output: error: {exc.filename or 'output'}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
