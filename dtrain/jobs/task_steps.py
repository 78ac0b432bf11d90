"""The batch script's lines for a task's parts (dtrain/jobs/task_file.py): its secrets, its setup once per
node, and per-node mode, where the user's command (their own torchrun, accelerate, deepspeed) runs once
per node with the rendezvous in its environment. Pure functions of a JobSpec (dtrain/jobs/job_spec.py) to
lines for job.sh's sections and its launch line; run on the operator's machine.

Secrets: `launch` sends them in the same tar over SSH's stdin as job.sh (never in argv), to
`<run>/secrets/env` (0600, in the 0700 run directory, owned by the submitting user). Only the user's own
processes read them: the batch script, srun, slurmstepd, the launchers and our tools do not hold them in
their environment; a wrapper sources the file just before it execs the user's command (setup, run, or
each rank under our torchrun/horovodrun, whose own environment horovodrun would put on its ssh command
lines). The file is removed when the job ends, unless Slurm is to run it again (a requeue). What the
user's command prints reaches the logs with the secrets' values masked (dtrain/remote/job/job_secrets.py):
setup's lines through job_secrets.py, the launch's through annotate_output.py.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from dtrain.cluster.ssh import q
from dtrain.jobs import time_warning
from dtrain.jobs.job_spec import JobSpec, ScriptLines
from infra.contract import PREEMPTED_EXIT_CODE

SECRETS_SUBDIR = "secrets"  # in the run directory; never uploaded (upload_results.py SKIPPED_DIRS)
SETUP_FILE = "setup.sh"  # in the run directory: the task's setup text
SETUP_CACHE = ".dtrain-setup"  # under a node's local disk (or the runs directory): setup_once.py's markers
# What setup and per-node mode's run get on every node (docs/operator.md): ours, and SkyPilot's names for the
# same values as its docs define them ("SkyPilot environment variables"), so that a SkyPilot task runs as
# written. The node's rank is set per node (from SLURM_NODEID, by user_command's wrapper), the rest once
# for the job (_node_env_lines), the rendezvous for per-node mode's run (per_node_lines).
NODE_RANK_ENV = ("DTRAIN_NODE_RANK", "SKYPILOT_NODE_RANK", "SKYPILOT_SETUP_NODE_RANK")
JOB_ENV = (
    "DTRAIN_NUM_NODES", "DTRAIN_NODE_LIST", "DTRAIN_GPUS_PER_NODE", "DTRAIN_PROCESSES_PER_NODE",
    "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS", "SKYPILOT_SETUP_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE",
    "SKYPILOT_SETUP_NUM_GPUS_PER_NODE", "SKYPILOT_TASK_ID", "SKYPILOT_CLUSTER_INFO",
)  # fmt: skip
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")
RANK_EXPORT = "export " + " ".join(f'{name}="$SLURM_NODEID"' for name in NODE_RANK_ENV) + "; "
# SKYPILOT_NODE_IPS: each node's IPv4 address, one a line in rank order, resolved on the first node (a name
# that resolves to none but loopback stays a name: where a host file maps its own name to 127.0.1.1)
NODE_IPS = (
    'while read -r node; do getent ahostsv4 "$node" '
    "| awk -v node=\"$node\" '$1 !~ /^127[.]/ { print $1; found = 1; exit } END { if (!found) print node }'; "
    'done <"$RUN_DIR/nodes"'
)


def secrets_dir(run_dir: str) -> str:
    return posixpath.join(run_dir, SECRETS_SUBDIR)


def secrets_file(run_dir: str) -> str:
    return posixpath.join(secrets_dir(run_dir), "env")


def user_command(spec: JobSpec, command: Sequence[str], per_node: bool = False) -> list[str]:
    """command, preceded where needed by a wrapper that exports the node's rank (per_node: setup, per-node
    mode's run) and sources the secrets in the process that then execs it (so that nothing above it holds them)."""
    script = RANK_EXPORT if per_node else ""
    if spec.secrets:
        script += f"set -a; . {q(secrets_file(spec.run_dir))}; set +a; "
    if not script:
        return list(command)
    return ["sh", "-c", script + 'exec "$@"', "dtrain-env", *command]


def secrets_mask_flag(spec: JobSpec) -> str:
    """annotate_output.py's flag that masks the secrets' values in the launch's log, rank logs and verdict."""
    return f" --secrets {q(secrets_file(spec.run_dir))}" if spec.secrets else ""


def _masked(spec: JobSpec) -> str:
    """The end of a step's line whose output reaches the log through job_secrets.py, its secrets masked."""
    return f' 2>&1 | "$PY" "$TOOLS/job_secrets.py" {q(secrets_file(spec.run_dir))}' if spec.secrets else ""


def script_lines(spec: JobSpec, step: str, runner: Sequence[str]) -> ScriptLines:
    """Before the launch: the variables every node's setup (and per-node run) shares, then setup; in
    finish(): the secrets removed. step: what runs a command once per node (srun); runner: what starts a
    command in the job's environment there (env PATH=..., or docker run)."""
    setup = _setup_lines(spec, step, runner)
    return ScriptLines(
        before_launch=[*_node_env_lines(spec), *setup, *_forget_node_env(spec)],
        on_finish=_forget_secrets(spec),
        runs_steps=bool(setup),
    )


def _forget_secrets(spec: JobSpec) -> list[str]:
    """For finish(): remove the secrets unless Slurm runs the job again (a Spot eviction, our requeue, the
    gate's requeue without a slow node)."""
    if not spec.secrets:
        return []
    remove = f"rm -rf {q(secrets_dir(spec.run_dir))}"
    if not (spec.requeue or spec.gated):
        return [f"  {remove}"]
    return [f'  [ "$code" -eq {PREEMPTED_EXIT_CODE} ] || [ -n "${{REQUEUED:-}}" ] || {remove}']


def runs_per_node(spec: JobSpec) -> bool:
    """Whether the user's command runs once per node (setup, per-node mode), given NODE_RANK_ENV and JOB_ENV."""
    return spec.mode == "per-node" or spec.setup_cache_dir is not None


def docker_env(spec: JobSpec) -> list[str]:
    """The variables a container must be given (-e NAME) for the user's setup and per-node mode."""
    if not runs_per_node(spec):
        return []
    return ["SLURM_NODEID", *JOB_ENV, *(RENDEZVOUS_ENV if spec.mode == "per-node" else ())]


def _node_env_lines(spec: JobSpec) -> list[str]:
    """The exports of JOB_ENV in the batch shell, before setup: what every node's setup and run share."""
    if not runs_per_node(spec):
        return []
    gpus = spec.gpus_per_node  # SkyPilot's count: 0 on CPU nodes, as SkyPilot says it without accelerators
    values = {
        "DTRAIN_NUM_NODES": spec.nodes, "DTRAIN_GPUS_PER_NODE": gpus,
        "DTRAIN_PROCESSES_PER_NODE": spec.processes_per_node, "SKYPILOT_NUM_NODES": spec.nodes,
        "SKYPILOT_NUM_GPUS_PER_NODE": gpus, "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": gpus,
        "SKYPILOT_TASK_ID": spec.run_id,  # the same over every attempt, as a managed job's recoveries keep theirs
        "SKYPILOT_CLUSTER_INFO": spec.cluster_info,
    }  # fmt: skip
    return [
        f"export {' '.join(f'{name}={q(str(value))}' for name, value in values.items())}",
        'DTRAIN_NODE_LIST=$(cat "$RUN_DIR/nodes") && export DTRAIN_NODE_LIST',
        f'SKYPILOT_NODE_IPS=$({NODE_IPS}) && export SKYPILOT_NODE_IPS SKYPILOT_SETUP_NODE_IPS="$SKYPILOT_NODE_IPS"',
    ]


def _forget_node_env(spec: JobSpec) -> list[str]:
    """After setup, in per-rank mode: the ranks under our launcher get RANK and the like, not JOB_ENV."""
    return [f"unset {' '.join(JOB_ENV)}"] if spec.mode != "per-node" and runs_per_node(spec) else []


def _setup_lines(spec: JobSpec, step: str, runner: Sequence[str]) -> list[str]:
    """Setup on every node through setup_once.py, before the run; a failure ends the job (the verdict
    names setup)."""
    if spec.setup_cache_dir is None:
        return []
    setup = posixpath.join(spec.run_dir, SETUP_FILE)
    command = [*runner, *(q(word) for word in user_command(spec, ["bash", setup], per_node=True))]
    tool = [
        '"$PY"', '"$TOOLS/setup_once.py"', "--code", q(spec.workdir), "--setup", q(setup),
        "--cache-dir", q(spec.setup_cache_dir), "--salt", q(spec.image or ""), "--", *command,
    ]  # fmt: skip
    failed = f"{{ code=$?; {time_warning.AT_THE_LIMIT}; echo '[job] setup failed: run not started'; exit $code; }}"
    setup_step = f"{step} {' '.join(tool)}{_masked(spec)}"
    return [
        "echo '[job] setup on every node (skipped where it ran before for this code and setup)'",
        # run_step (batch_script.py): in the background, so that a setup that runs into the time limit is
        # closed as the limit's; eval, so that the masking pipe goes with it (pipefail: setup's status)
        f"run_step eval {q(setup_step)} || {failed}",
    ]


def per_node_lines(spec: JobSpec, step: str, runner: Sequence[str], rendezvous_port: str) -> list[str]:
    """Per-node mode: the export of the rendezvous, then the user's command once per node (the last line)."""
    export = (
        f'MASTER_ADDR=$(head -n1 "$RUN_DIR/nodes") MASTER_PORT=$(({rendezvous_port})) && export MASTER_ADDR MASTER_PORT'
    )
    command = " ".join(q(word) for word in user_command(spec, spec.command, per_node=True))
    return [export, f"{step} {' '.join(runner)} {command}"]


def setup_cache_dir(local_data_path: str | None, runs_dir: str) -> str:
    """Where setup_once.py keeps its markers: the nodes' own disk (wiped with the node), else the share."""
    return posixpath.join(local_data_path or runs_dir, SETUP_CACHE)
