"""Slurm accounting on the local cluster (dtrain/local/accounting.py): real MariaDB and slurmdbd in the head
namespace. A job's record reaches the database (sacct) with its allocation even when slurmdbd is down as
the job ends and slurmctld restarts meanwhile, and the associations that AccountingStorageEnforce needs are
made idempotently."""

from __future__ import annotations

import getpass
import os
import signal
from pathlib import Path

from dtrain.local import accounting as local_accounting
from dtrain.local import slurm_conf
from dtrain.local.nodes import start_daemon
from dtrain.local.state import load_state
from infra.cloud_init.accounting import DEFAULT_ACCOUNT
from tests.polling import wait_for

from .conftest import local_state_dir, slurm_command
from .test_job_reliability import start_slurmctld

# How long slurmctld may take to hand slurmdbd what it queued while slurmdbd was down: its agent tries
# again every few seconds once it has records to send; a loaded machine adds its share.
RECORD_ARRIVES_S = 120


def stop(cluster, role: str) -> None:
    """A daemon stopped as an operator stops it (SIGTERM: slurmctld saves its state and its queue of
    records for slurmdbd)."""
    record = load_state(local_state_dir(cluster)).record(role)
    assert record is not None and record.alive()
    os.kill(record.pid, signal.SIGTERM)
    wait_for(lambda: not record.alive(), 30, f"{role} to stop", interval=0.2)


def start_slurmdbd(cluster) -> None:
    state = load_state(local_state_dir(cluster))
    assert state.head is not None and state.head.namespace and state.slurm_conf
    files = slurm_conf.SlurmFiles(Path(state.state_dir))
    argv = local_accounting.slurmdbd_argv(state.head.namespace, files)
    start_daemon(state, local_accounting.SLURMDBD_ROLE, argv, str(local_accounting.slurmdbd_link(files)))


def accounted(cluster, job_id: str) -> dict[str, str] | None:
    """The job's record in the database (sacct), or None while it has none or slurmdbd does not answer."""
    fields = ("JobID", "User", "Account", "State", "ExitCode", "AllocTRES", "Start", "End")
    proc = slurm_command(cluster, "sacct", "-X", "-n", "-P", "-j", job_id, f"--format={','.join(fields)}")
    lines = proc.stdout.splitlines() if proc.returncode == 0 else []
    return dict(zip(fields, lines[0].split("|"), strict=True)) if lines else None


def test_a_jobs_record_survives_slurmdbd_down_and_slurmctld_restarted_while_it_runs(cluster, tmp_path):
    release = Path(cluster.shared_mount_path) / f"release-{tmp_path.name}"
    submitted = slurm_command(
        cluster, "sbatch", "--parsable", "--output=/dev/null",
        f"--wrap=while [ ! -e {release} ]; do sleep 0.2; done",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    running = slurm_command(cluster, "squeue", "-h", "-j", job_id, "-o", "%T")
    wait_for(
        lambda: slurm_command(cluster, "squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() == "RUNNING",
        60,
        f"job {job_id} to run ({running.stdout.strip()})",
        interval=0.2,
    )
    stop(cluster, local_accounting.SLURMDBD_ROLE)
    try:
        stop(cluster, "slurmctld")
        start_slurmctld(cluster)  # with slurmdbd still down: its queued records come back from its state
        release.touch()  # the job ends while slurmdbd is down
        wait_for(
            lambda: slurm_command(cluster, "scontrol", "show", "job", job_id).stdout.count("JobState=COMPLETED"),
            60,
            f"job {job_id} to complete",
            interval=0.2,
        )
    finally:
        start_slurmdbd(cluster)
    record = wait_for(
        lambda: (found := accounted(cluster, job_id)) and found["State"] == "COMPLETED" and found,
        RECORD_ARRIVES_S,
        f"job {job_id}'s end in sacct",
        interval=0.5,
    )
    assert (record["User"], record["Account"], record["ExitCode"]) == (getpass.getuser(), DEFAULT_ACCOUNT, "0:0")
    assert "cpu=1" in record["AllocTRES"] and "node=1" in record["AllocTRES"], record
    assert record["Start"] <= record["End"], record


def test_the_associations_load_again_without_change(cluster):
    """What `up` loads (the cluster, its default account and this user) can be loaded again: setup reruns."""
    state = load_state(local_state_dir(cluster))
    files = slurm_conf.SlurmFiles(Path(state.state_dir))

    def associations() -> list[str]:
        shown = slurm_command(cluster, "sacctmgr", "-n", "-P", "show", "associations", "format=cluster,account,user")
        assert shown.returncode == 0, shown.stderr
        return sorted(shown.stdout.splitlines())

    before = associations()
    name = state.slurm_cluster_name
    assert f"{name}|{DEFAULT_ACCOUNT}|{getpass.getuser()}" in before, before
    local_accounting.load_associations(state, files, [getpass.getuser()])
    assert associations() == before
    user = slurm_command(cluster, "sacctmgr", "-n", "-P", "show", "user", getpass.getuser(), "format=defaultaccount")
    assert user.stdout.strip() == DEFAULT_ACCOUNT
