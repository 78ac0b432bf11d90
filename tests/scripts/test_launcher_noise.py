"""What `launch` shows of a followed job's log: a launcher's traceback stays in the log only."""

from __future__ import annotations

from dtrain.jobs.launcher_noise import without_launcher_tracebacks

# The end of a model-parallel run that refused its layout on two nodes (torchrun under srun), as
# dtrain/remote/job/annotate_output.py writes it into output.log.
LOG = """\
[0|node-0]! error: --tp 1 x --pp 3 = 3 does not divide the world size 2
[torchrun@node-1] Traceback (most recent call last):
[torchrun@node-1]   File "/venv/bin/torchrun", line 7, in <module>
[torchrun@node-1]     sys.exit(main())
[torchrun@node-0] W1125 Sending process 31611 closing signal SIGTERM
[torchrun@node-1] torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection failed.
[torchrun@node-0] Traceback (most recent call last):
[torchrun@node-0]   File "/venv/bin/torchrun", line 7, in <module>
[torchrun@node-0] torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
[torchrun@node-0] ============================================================
[torchrun] srun: error: node-0: task 0: Exited with exit code 1
[job] exit status 2"""


def test_a_launchers_lines_from_its_traceback_on_are_hidden_and_nothing_else():
    shown: list[str] = []
    echo = without_launcher_tracebacks(shown.append)
    for line in LOG.splitlines():
        echo(line)
    assert shown == [
        "[0|node-0]! error: --tp 1 x --pp 3 = 3 does not divide the world size 2",
        "[torchrun@node-0] W1125 Sending process 31611 closing signal SIGTERM",  # before node-0's traceback
        "[torchrun] srun: error: node-0: task 0: Exited with exit code 1",
        "[job] exit status 2",
    ]


def test_a_traceback_that_a_launcher_logs_is_hidden_and_its_later_lines_are_not():
    header = "E1127 21:37:22.981000 55 torch/distributed/elastic/multiprocessing/tail_log.py:154] "
    log = [
        f"[torchrun@node-0] {header}error in log tailor for default0. SignalException: Process 55 got signal: 15",
        f"[torchrun@node-0] {header}Traceback (most recent call last):",
        f'[torchrun@node-0] {header}  File "tail_log.py", line 152, in stop',
        f"[torchrun@node-0] {header}SignalException: Process 55 got signal: 15",
        "[torchrun@node-0] W1127 21:37:23.100000 55 api.py:753] Received 15 death signal, shutting down workers",
        "[job] exit status 143",
    ]
    shown: list[str] = []
    echo = without_launcher_tracebacks(shown.append)
    for line in log:
        echo(line)
    assert shown == [log[0], log[4], log[5]]
