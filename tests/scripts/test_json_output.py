"""`--json` of every command that takes it, the way a script reads it: one JSON document on stdout that
validates against the command's schema (dtrain/json_documents.py, strictly: no key missing or extra,
no value of another type) on success, and against the error document on failure, with the exit status
and the `error:` line on stderr that the same command gives without --json. `jobs` and `status` run
against the local cluster; the failures and `cost` need none (`doctor`'s document: test_doctor.py)."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from dtrain.__main__ import build_parser
from dtrain.cli.jobs import job_rows
from dtrain.cli_entry import CLIParser, run_cli
from dtrain.cluster.slurm import QueuedJob
from dtrain.errors import ExitCode
from dtrain.jobs.runs import Run
from dtrain.json_documents import (
    CostDocument,
    DoctorDocument,
    Document,
    ErrorDocument,
    JobsDocument,
    StatusDocument,
)
from tests.polling import wait_for

from .conftest import run_module
from .test_launcher import cli, launch_args, start_long_job, status_of

SCHEMAS: dict[str, type[Document]] = {
    "jobs": JobsDocument,
    "status": StatusDocument,
    "cost": CostDocument,
    "doctor": DoctorDocument,  # its document: tests/scripts/test_doctor.py, against Resource Manager served here
}
MISSING = "/nonexistent.json"


def commands_with_json(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> set[str]:
    """Every (sub)command of the parser that takes --json, as its words."""
    found = {" ".join(words)} if "--json" in parser._option_string_actions else set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= commands_with_json(sub, (*words, name))
    return found


def dtrain(*argv: str) -> subprocess.CompletedProcess:
    return run_module("dtrain", *argv, timeout=120)


def test_every_command_with_json_has_a_schema_checked_here():
    assert commands_with_json(build_parser()) == set(SCHEMAS)


FAILURES = [
    ("jobs", "--cluster", MISSING),
    ("status", "--cluster", MISSING),
    ("cost", "--stack-file", "/nonexistent.yaml"),
    ("cost", "--live", "--cluster", MISSING),
    ("cost", "--by", "user", "--cluster", MISSING),
    ("cost", "--by", "user", "--since", "garbage"),  # a usage error
    ("doctor", "--stack-file", "/nonexistent.yaml"),
    ("jobs", "--limit", "0"),  # refused by the parser: a usage error
    ("status", "--no-such-flag"),
]


@pytest.mark.parametrize("argv", FAILURES, ids=" ".join)
def test_a_failure_prints_an_error_document_and_keeps_its_exit_status_and_error_line(argv):
    plain, scripted = dtrain(*argv), dtrain(*argv, "--json")
    assert plain.returncode != 0 and plain.stdout == "", plain.stderr
    assert scripted.returncode == plain.returncode and scripted.stderr == plain.stderr
    error = ErrorDocument.model_validate_json(scripted.stdout, strict=True).error
    assert error.exit_status == scripted.returncode
    assert f"error: {error.message}\n" in scripted.stderr
    assert "Traceback" not in scripted.stdout + scripted.stderr


@pytest.mark.parametrize(
    ("raised", "code"),
    [(KeyError("boom"), ExitCode.FAILED), (KeyboardInterrupt(), ExitCode.INTERRUPTED)],
    ids=["unexpected", "interrupted"],
)
def test_an_unexpected_error_and_an_interrupt_print_the_error_document_too(raised, code, capsys):
    parser = CLIParser(prog="tool")
    parser.add_argument("--json", action="store_true")

    def body(_args: argparse.Namespace) -> int:
        raise raised

    assert run_cli(parser, body, ["--json"]) == code
    out, err = capsys.readouterr()
    error = ErrorDocument.model_validate_json(out, strict=True).error
    assert error.exit_status == code and f"error: {error.message}" in err


def test_cost_prints_its_document():
    proc = dtrain("cost", "--json", "--running-nodes", "1")
    assert proc.returncode == 0, proc.stderr
    document = CostDocument.model_validate_json(proc.stdout, strict=True)
    assert document.rows and document.currency == "USD"


def test_jobs_rows_of_a_running_and_an_ended_job_have_the_same_keys_and_types(cluster, cluster_file):
    ended = cli(*launch_args(cluster_file, "--steps", "2", run_id="json-ended", nodes=1, extra=("--detach",)))
    assert ended.returncode == 0, ended.stderr
    wait_for(lambda: status_of(cluster, "json-ended"), 180, "json-ended to end", interval=1)
    running_job = start_long_job(cluster, cluster_file, "json-running")
    try:
        proc = dtrain("jobs", "--cluster", str(cluster_file), "--json")
        assert proc.returncode == 0, proc.stderr
        JobsDocument.model_validate_json(proc.stdout, strict=True)
        rows = {row["run"]: row for row in json.loads(proc.stdout)["jobs"]}
        running, done = rows["json-running"], rows["json-ended"]
        assert running.keys() == done.keys()
        for key in running:  # one type per key; null where there is no value
            assert None in (running[key], done[key]) or type(running[key]) is type(done[key]), key
        assert (running["job"], running["state"], running["in_queue"]) == (running_job, "RUNNING", True)
        assert (running["nodes"], running["finished_at"], running["exit_code"]) == (2, None, None)
        assert isinstance(running["elapsed_seconds"], int)
        assert (done["state"], done["in_queue"], done["nodes"], done["exit_code"]) == ("COMPLETED", False, 1, 0)
        assert isinstance(done["finished_at"], str) and isinstance(done["elapsed_seconds"], int)

        status = dtrain("status", "--cluster", str(cluster_file), "--json")
        assert status.returncode == 0, status.stderr
        document = StatusDocument.model_validate_json(status.stdout, strict=True)
        assert [node.name for node in document.nodes] == ["node-0", "node-1"]
        queued = next(job for job in document.queue if job.run == "json-running")
        assert (queued.job, queued.state, queued.nodes) == (running_job, "RUNNING", 2)
    finally:
        cli("cancel", "--cluster", str(cluster_file), running_job)


def test_a_queued_and_an_ended_row_have_the_same_keys_and_types_without_a_cluster():
    queued = QueuedJob("7", "run-a", "RUNNING", "alice", "2", "1-02:03:04", "node-[0-1]")
    ended = Run(
        "run-b",
        "6",
        "/shared/runs/run-b",
        job={"nodes": 1, "submitted_by": "alice"},
        status={"exit_code": 0, "finished_at": "2026-11-27T21:00:00+00:00"},
        record={"attempts": [{"seconds": 12}], "node_hours": 0.003, "estimated_cost_usd": None},
    )
    rows = [dict(row) for row in job_rows([queued], [ended], {})]
    JobsDocument.model_validate({"jobs": rows}, strict=True)
    shown = [(row["nodes"], row["elapsed_seconds"], row["in_queue"]) for row in rows]
    assert shown == [(2, 93784, True), (1, 12, False)]
