"""Docker-runtime jobs as the admin user, as Azure runs them (here everything else runs as root): a
throwaway user made by the test gets what a node's setup gives the admin user (membership of the
docker group, from node-setup; the registry credential, from acr-login running `docker login` as that
user), and then the one job script (dtrain/jobs/batch_script.py), run as that user, reaches `docker run`
with the group and a credential its client can read. There is no docker engine here: a stand-in
`docker` on PATH logs in as docker does (config.json, 0600) and records what `docker run` sees."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrain.jobs.batch_script import render_job_script
from dtrain.jobs.job_spec import JobSpec, ResultsTarget
from tests.infra.documents import ACR, node_doc, script_of, slurm_conf
from tests.infra.sandbox import Sandbox, with_value
from tests.infra.test_cloud_init import acr_login_in

# docker's own lookup: $DOCKER_CONFIG, else ~/.docker; login writes config.json 0600 in a 0700 folder
DOCKER = """config="${DOCKER_CONFIG:-$HOME/.docker}"
if [ "$1" = login ]; then
  password=$(cat) && mkdir -p -m 0700 "$config" && umask 077 &&
    auth=$(printf '%s:%s' "$4" "$password" | base64 -w0) &&
    printf '{"auths": {"%s": {"auth": "%s"}}}\\n' "$2" "$auth" >"$config/config.json"
  exit
fi
printf '%s\\n' "$*" >"$RECORD.argv"
printf '{"uid": %s, "groups": "%s", "docker_config": "%s", "home": "%s"}\\n' \\
  "$(id -u)" "$(id -G)" "${DOCKER_CONFIG:-}" "$HOME" >"$RECORD"
cp "$config/config.json" "$RECORD.config" || exit 1"""
# Slurm, as far as a one-node job script needs it: srun runs its command here, scontrol names the node
SRUN = 'while [ "${1#-}" != "$1" ]; do shift; done; exec "$@"'
SCONTROL = 'echo "$SLURM_JOB_NODELIST"'


@dataclass(frozen=True)
class AdminUser:
    name: str
    home: Path
    group: str  # stands for the image's docker group


@pytest.fixture
def machine() -> Iterator[Path]:
    """A folder every user may traverse (pytest's own tmp_path is root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="dtrain-docker-user-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def admin(machine: Path) -> Iterator[AdminUser]:
    user = AdminUser(f"dtadm{os.getpid()}", machine / "home", f"dtdock{os.getpid()}")
    subprocess.run(["groupadd", user.group], check=True)
    subprocess.run(["useradd", "--create-home", "--home-dir", str(user.home), user.name], check=True)
    try:
        yield user
    finally:
        subprocess.run(["userdel", "--remove", user.name], check=False, capture_output=True)
        subprocess.run(["groupdel", user.group], check=False)


def sandbox_for_all(machine: Path) -> Sandbox:
    """A sandbox whose stubs the admin user may run and log to."""
    (machine / "sandbox").mkdir()
    sandbox = Sandbox(machine / "sandbox")
    for path in (sandbox.root, sandbox.bin):
        path.chmod(0o755)
    sandbox.state.chmod(0o777)
    sandbox.log.chmod(0o666)
    return sandbox


def set_up_node_for(admin: AdminUser, sandbox: Sandbox) -> None:
    """The node's setup, for real where it concerns the admin user (usermod, runuser, getent)."""
    setup = script_of(node_doc(admin_user=admin.name), "/usr/local/sbin/node-setup")
    setup = with_value(setup, "DOCKER_GROUP", admin.group)
    setup = with_value(setup, "STEPS_DIR", str(sandbox.root / "steps"))
    setup = with_value(setup, "DONE_FILE", str(sandbox.root / "done"))
    for name in ("nfs-mount", "systemctl", "slurmd-setup", "hostname"):
        sandbox.stub(name)
    sandbox.stub("mountpoint", "exit 1")
    sandbox.stub("dpkg-query", "echo installed")  # the packages step: all there, apt is not asked
    result = sandbox.run(setup)
    assert result.returncode == 0, result.stderr
    login = acr_login_in(sandbox, admin_user=admin.name)
    sandbox.stub("docker", DOCKER)
    result = sandbox.run(login)
    assert result.returncode == 0, result.stderr


def test_a_docker_runtime_job_runs_docker_as_the_admin_user_with_the_group_and_the_registry_credential(
    machine: Path, admin: AdminUser
) -> None:
    sandbox = sandbox_for_all(machine)
    set_up_node_for(admin, sandbox)
    credential = admin.home / ".docker" / "config.json"
    owner = pwd.getpwnam(admin.name)
    # the user's alone: neither root's nor readable by anyone else
    assert (credential.stat().st_uid, stat.S_IMODE(credential.stat().st_mode)) == (owner.pw_uid, 0o600)
    assert stat.S_IMODE(credential.parent.stat().st_mode) == 0o700

    run_dir = machine / "runs" / "r-1"
    run_dir.mkdir(parents=True)
    shutil.chown(run_dir, admin.name)
    spec = JobSpec(
        run_id="r-1",
        run_dir=str(run_dir),
        launcher="torchrun",
        nodes=1,
        processes_per_node=1,
        gpus_per_node=1,
        partition="gpu",
        command=["python3", "-m", "training.pytorch"],
        workdir="/workspace",
        python="python3",
        remote_python="python3",
        results=ResultsTarget("https://acct.blob.core.windows.net", "results", client_id="0000-1111"),
        image=f"{ACR}/hvd-pytorch:latest",
    )
    (run_dir / "job.sh").write_text(render_job_script(spec))
    shutil.copytree(
        Path(__file__).resolve().parents[2] / "dtrain" / "remote" / "job", run_dir / "remote"
    )  # as launch does
    jobs_bin = machine / "job-bin"
    jobs_bin.mkdir(mode=0o755)
    for name, body in (("docker", DOCKER), ("srun", SRUN), ("scontrol", SCONTROL)):
        (jobs_bin / name).write_text(f"#!/bin/bash\n{body}\n")
        (jobs_bin / name).chmod(0o755)
    record = run_dir / "docker-run.json"  # written by the stand-in docker, as the user
    # what slurmstepd gives a job: the submitter's uid with the groups the node knows, and the
    # environment of its submission (HOME included)
    slurm_env = {
        "PATH": f"{jobs_bin}:/usr/bin:/bin", "HOME": str(admin.home), "RECORD": str(record),
        "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-0", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_GPUS": "0",
    }  # fmt: skip
    env_args = [f"{key}={value}" for key, value in slurm_env.items()]
    job = subprocess.run(
        ["runuser", "-u", admin.name, "--", "env", "-i", *env_args, "bash", str(run_dir / "job.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    seen = json.loads(record.read_text()) if record.exists() else {}
    assert seen, job.stdout + job.stderr
    argv = Path(f"{record}.argv").read_text()
    assert argv.startswith('run --gpus "device=0" --rm') and f" {ACR}/hvd-pytorch:latest sh -c " in argv
    assert seen["uid"] == owner.pw_uid
    assert str(grp.getgrnam(admin.group).gr_gid) in seen["groups"].split()  # the docker socket's group
    assert seen["docker_config"] == "" and seen["home"] == str(admin.home)  # so the client reads ~/.docker
    assert ACR in json.loads(Path(f"{record}.config").read_text())["auths"]


def test_slurm_reads_a_jobs_groups_on_its_node_where_the_admin_user_is_in_the_docker_group() -> None:
    """By default slurmctld resolves a job's groups on the head node (send_gids), which has no docker
    group: the node's membership would never reach the job."""
    assert "LaunchParameters=disable_send_gids" in slurm_conf().splitlines()
