"""The product's one exit-status table: the operator's `dtrain`, the training jobs and the launch that
passes a job's status through all exit with these codes, so a status keeps its meaning end to end.

| exit | meaning |
| ---- | ------- |
| 0    | success |
| 1    | failed: the job or a remote step failed (a peer died, a collective timed out), or an internal error |
| 2    | bad input: usage, a flag, a path, a file or config, a checkpoint that does not fit (fix them) |
| 3    | not ready: a tool or package missing, not root, a cluster or storage unreachable, access refused |
| 4    | timed out: gave up waiting (for nodes, for a remote command) |
| 75   | preempted: a Spot eviction was announced (SIGUSR1); the checkpoint is saved, requeue the job |
| 130  | interrupted (Ctrl-C) |

Standard library only, so that both sides import it: ``dtrain`` (without torch), ``training`` (without
Pulumi) and ``infra``. The host tools under dtrain/remote/ stand alone (stdlib, one file each) and
repeat the values they need; tests/test_layout.py checks that they match this table.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the job or a remote step failed, or an unexpected internal error
    BAD_INPUT = 2  # usage, flag values, missing/unreadable/invalid files or config: fix the command or the file
    NOT_READY = 3  # a tool missing, not root, cluster or storage unreachable, access refused by a service
    TIMED_OUT = 4  # gave up waiting (for nodes, for a remote command)
    PREEMPTED = 75  # sysexits' EX_TEMPFAIL: try again later (the node agent requeues the job)
    INTERRUPTED = 130  # Ctrl-C
