"""The batch script of a run (`job.sh`, submitted with sbatch): pure functions from a JobSpec to bash.
Runs on the operator's machine. Each feature of the script (tracking.py, node_gate.py, checkpoint_sync.py,
task_steps.py) returns its lines for job.sh's named sections (job_spec.ScriptLines); this module orders
them within each section, and writes the rest: the Slurm header, the prologue, finish() and the launch.

What the script does, on the first node of the allocation, whoever is attached:
  1. writes the allocation's node list (rank -> host) and clears the verdict of an earlier attempt
     (a requeued job runs the script again, and resumes from the run's checkpoints); on two or more
     nodes, measures them first (the gate, dtrain/jobs/node_gate.py) and requeues itself without a slow one;
  2. runs the job: Horovod with `horovodrun` on a hostfile made from the allocation, its remote workers
     started as Slurm job steps through `remote/bin/ssh` (dtrain/remote/job/srun_ssh.py), so that Slurm
     tracks and kills every process; DDP with `torchrun` under `srun`, one per node. The docker runtime
     runs the same launchers in the framework's image, one container per node (the nodes' Epilog
     removes the job's containers, which dockerd owns, not Slurm);
  3. pipes the launcher's output through remote/annotate_output.py: `[rank|host]` on every line, a log per
     rank, and the verdict (which rank failed and why);
  4. on exit, even after scancel or the time limit (SIGTERM, then SIGKILL after KillWait: the closing runs
     in between, see _closing_on_term), writes status.json and run.json
     (this attempt's node-hours and estimated cost, added to earlier attempts'), and uploads the run
     directory (the model export, curves and logs; not its checkpoints or secrets) to the results container,
     in parallel, status.json last, saying what did not make it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dtrain.cluster.ssh import q
from dtrain.jobs import checkpoint_sync, node_gate, task_steps, time_warning, tracking
from dtrain.jobs.allocation import WHOLE_NODE_FLAGS
from dtrain.jobs.job_spec import JobSpec, LocalCopy, ScriptLines
from dtrain.remote.job.annotate_output import TORCHRUN_PREFIX_TEMPLATE
from infra.contract import CONTAINER_SSH_PORT, LAUNCH_END_WAIT_S, PREEMPTED_EXIT_CODE

NODE_PROBE_S = 60  # how long a node may take to run an empty job step before it counts as failed
RDZV_PORT_BASE = 29400  # torchrun's rendezvous on the first node: this plus the job id modulo 1000
OUTPUT_SUBDIR = "output"  # $OUTPUT_DIR of a run: uploaded to the results container with the run's logs
REMOTE_TOOLS = ("annotate_output.py", "record_run.py", "upload_results.py", "srun_ssh.py", "nvme_copy.py")
REMOTE_TOOLS += ("checkpoint_mirror.py", "fetch_checkpoint.py", "time_warning.py", "setup_once.py", "mlflow_run.py")
REMOTE_TOOLS += ("job_secrets.py", "system_metrics.py", "node_gate.py")
# from dtrain/remote/boot/, beside them: time_warning.py finds the ranks to signal the Spot agent's way
REMOTE_BOOT_TOOLS = ("spot_agent.py",)
# --ntasks too: the allocation's SLURM_NTASKS (nodes x processes) would otherwise win over per-node
DOCKER_RUN_WITH_JOB_GPUS = (
    "sh -c " + q('exec docker run --gpus "\\"device=${SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}\\"" "$@"') + " docker-run"
)
ONE_TASK_PER_NODE = '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1'
EVERY_NODE_STEP = f"srun --label --overlap --kill-on-bad-exit=1 {ONE_TASK_PER_NODE}"  # once per node, one fails all
# torchrun prefixes each line of a rank with this (it has no flag for it): the global rank, which
# annotate_output.py turns into [rank|host]. Quoted: torchrun, not bash, fills in ${rank}.
TORCHRUN_PREFIX = f"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE={q(TORCHRUN_PREFIX_TEMPLATE)}"
# A Spot eviction's SIGUSR1 (dtrain/remote/boot/spot_agent.py) is for the training ranks, which catch it. The
# agent signals only the job's processes that catch it, and not srun or docker, which would forward it to
# tasks that may have no handler yet (spot_agent.FORWARDERS). Slurm's time warning signals the batch shell:
# it ignores USR1 until its trap, and so does what it starts (an ignored signal stays ignored across exec);
# a step's tasks start afresh, so they go through this wrapper first.
IGNORE_USR1 = 'trap "" USR1;'
IGNORING_USR1 = f"sh -c '{IGNORE_USR1} exec \"$@\"' ignore-usr1"


def render_job_script(spec: JobSpec) -> str:
    requeue = _requeue_on_node_failure(keeps_secrets=bool(spec.secrets)) if spec.requeue else []
    tracked = tracking.script_lines(spec.tracking)
    checkpoints = checkpoint_sync.script_lines(spec.run_id, spec.results, spec.resume_from)
    task = task_steps.script_lines(spec, EVERY_NODE_STEP, _user_runner(spec))
    # in the order they run: the nodes measured, the data copied, the checkpoint fetched, the user's setup
    steps = (_gate(spec), _local_copy(spec.local_copy), checkpoints, task)
    before_launch = [line for part in steps for line in part.before_launch]
    # the MLflow run closed before the secrets go (it may need the token), the mirror stopped before the upload
    on_finish = [line for part in (tracked, task, checkpoints) for line in part.on_finish]
    run_step = [RUN_STEP] if any(part.runs_steps for part in steps) else []
    body = [
        *_prologue(spec, tracked.prologue, on_finish),
        *run_step,
        *before_launch,
        *_launch(spec),
        *_epilogue(requeue),
    ]
    return "\n".join([*_header(spec), *body, ""])


def _header(spec: JobSpec) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"# Run {spec.run_id}: {spec.world_size} processes ({spec.launcher}) on {spec.nodes} nodes.",
        "# Written by `dtrain launch`; resubmit with `sbatch job.sh` from this directory.",
        "# shellcheck disable=SC2016  # the single-quoted commands expand their variables in the containers",
        f"#SBATCH --job-name={spec.run_id}",
        f"#SBATCH --partition={spec.partition}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={spec.processes_per_node}",
        f"#SBATCH --chdir={spec.run_dir}",
        f"#SBATCH --output={spec.run_dir}/output.log",
        "#SBATCH --open-mode=append",  # a requeued attempt adds to the same log
        "#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue",
    ]
    if spec.exclusive:
        lines += [f"#SBATCH {flag}" for flag in WHOLE_NODE_FLAGS]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{spec.gpus_per_node}")
    if spec.time_limit:
        lines.append(f"#SBATCH --time={spec.time_limit}")
    return lines + time_warning.header(spec.warn_before_s)


def _prologue(spec: JobSpec, opened: Sequence[str], on_finish: Sequence[str]) -> list[str]:
    """opened: the features' prologue lines (the EXIT trap is set by then); on_finish: theirs in finish()."""
    env = " ".join(f"{key}={q(value)}" for key, value in {"PYTHONUNBUFFERED": "1", **spec.env}.items())
    return [
        # first: Slurm may send the time warning as the job starts (up to a minute early: at once for a
        # short limit), and USR1 would end this shell before it ran a line more
        IGNORE_USR1.rstrip(";"),  # the signal is for the ranks (see IGNORING_USR1)
        "set -uo pipefail",
        "umask 077",
        "ATTEMPT_STARTED_AT=$(date -u +%s)",  # what run.json charges this attempt from
        # exported: the containers read them too (the model export records the run and the revision)
        f"export RUN_DIR={q(spec.run_dir)} RUN_ID={q(spec.run_id)} GIT_REVISION={q(spec.git_revision or '')}",
        # where any job (ours or the user's own code) leaves what should reach the results container
        f'export OUTPUT_DIR="$RUN_DIR/{OUTPUT_SUBDIR}" CHECKPOINT_DIR="$RUN_DIR/checkpoints"',
        'mkdir -p "$OUTPUT_DIR"',
        f"readonly PY={q(spec.remote_python)}",
        'readonly TOOLS="$RUN_DIR/remote"',
        f"export {env}",
        'export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"',  # horovodrun imports TensorFlow: no INFO noise
        'rm -f "$RUN_DIR/status.json" "$RUN_DIR/verdict.json"',
        'scontrol show hostnames "$SLURM_JOB_NODELIST" >"$RUN_DIR/nodes"',
        'HOSTS=$(paste -sd, "$RUN_DIR/nodes")',
        "readonly ATTEMPT=$((${SLURM_RESTART_COUNT:-0} + 1))",
        # on the shared run directory: an attempt whose node is lost with its record is still in run.json
        'echo "$ATTEMPT $ATTEMPT_STARTED_AT $SLURM_JOB_PARTITION" >>"$RUN_DIR/attempts.started"',
        # When the time limit ends the attempt (Slurm's EndTime of a running job): a SIGTERM from then on
        # is the time limit's, not a cancel (SLURM_JOB_END_TIME only exists from Slurm 23.02)
        'JOB_ENDS_AT=$(date -d "$(squeue -h -j "$SLURM_JOB_ID" -o %e)" +%s 2>/dev/null) || JOB_ENDS_AT=0',
        # what run.json charges: the allocation (GPUs, CPUs), and a node's CPUs to price a share of a CPU node
        # AllocTRES, in every version: with gres/gpu counted (AccountingStorageTRES, as slurmdbd records it)
        'ALLOC_TRES=$(squeue -h -j "$SLURM_JOB_ID" -O tres-alloc:500 2>/dev/null)',
        'NODE_CPUS=$(scontrol show node -o "${SLURMD_NODENAME:-}" 2>/dev/null | grep -o "CPUTot=[0-9]*" | cut -d= -f2)',
        "ENDED_BY=",
        'echo "[job] job $SLURM_JOB_ID, attempt $ATTEMPT, on $HOSTS (partition $SLURM_JOB_PARTITION)"',
        *_finish_function(spec, on_finish),
        "trap finish EXIT",
        *opened,
        *_closing_on_term(),
        "trap 'exit 130' INT",
    ]


def _closing_on_term() -> list[str]:
    """The TERM trap (a cancel, the time limit): Slurm sends SIGKILL KillWait seconds later, so the run is
    closed within that window. The running step (setup, the launch) gets a short while to end, so that
    its last lines (and the verdict) reach the log; srun alone would wait KillWait + 2 s for its tasks.
    A status goes first, should the closing not end in time (finish() replaces it with the full one)."""
    return [
        "# shellcheck disable=SC2317  # run by the TERM trap",
        "wait_for_step() {",
        "  local deadline=$((SECONDS + $1))",
        '  while [ -n "${STEP_PID:-}" ] && kill -0 "$STEP_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do',
        "    sleep 0.5",
        "  done",
        "}",
        "# shellcheck disable=SC2317  # run by the TERM trap",
        "closing_on_term() {",
        "  trap '' TERM",  # Slurm's second TERM, or a second scancel, must not cut the closing short
        f"  {time_warning.TIME_LIMIT_TEST} && ENDED_BY=time_limit",
        "  FINISHED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)",
        "  write_status 143 incomplete",
        f"  wait_for_step {LAUNCH_END_WAIT_S}",
        "  exit 143",
        "}",
        "trap closing_on_term TERM",
    ]


# What runs a step before the launch (the local copy, setup): in the background, waited for, so that the
# TERM trap runs at once (and closes the run in time), not when srun has waited for its tasks to end.
RUN_STEP = 'run_step() { "$@" & STEP_PID=$!; wait "$STEP_PID"; }'


def _finish_function(spec: JobSpec, on_finish: Sequence[str]) -> list[str]:
    upload = [
        '"$PY" "$TOOLS/upload_results.py" --dir "$RUN_DIR"',
        f"--prefix {q(spec.run_id)} --status status.json --with-checkpoints",
        checkpoint_sync.container_flags(spec.results),
    ]
    # results: "uploading" until upload_results.py sets the outcome, and uploads status.json last
    status = (
        'printf \'{"job_id": "%s", "run_id": "%s", "exit_code": %d, "attempt": %d, "finished_at": "%s", '
        '"results": "%s", "ended_by": "%s"}\\n\' '
        f'"$SLURM_JOB_ID" {q(spec.run_id)} "$1" "$ATTEMPT" "$FINISHED_AT" "$2" "$ENDED_BY" '
        '>"$RUN_DIR/status.json.tmp" && mv "$RUN_DIR/status.json.tmp" "$RUN_DIR/status.json"'
    )
    return [
        "# shellcheck disable=SC2317  # run by the EXIT trap",
        f"write_status() {{ {status}; }}",
        "# shellcheck disable=SC2317",
        "finish() {",
        "  local code=$?",
        "  trap - EXIT",
        "  trap '' TERM INT",  # the closing ends by itself, or by Slurm's SIGKILL: not by a second TERM
        f"  {IGNORE_USR1.rstrip(';')}",  # a late time-limit warning must not end the upload
        "  FINISHED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)",
        time_warning.ENDED_BY_WARNING,
        # a step Slurm ended at the limit may have ended before this shell's TERM came (a loaded node)
        f'  [ -z "$ENDED_BY" ] && [ "$code" -ne 0 ] && {time_warning.TIME_LIMIT_TEST} && ENDED_BY=time_limit',
        '  echo "[job] exit status $code${ENDED_BY:+ (ended by its time limit)}"',
        '  write_status "$code" uploading',
        f'  "$PY" "$TOOLS/record_run.py" --run-dir "$RUN_DIR" --nodes {spec.nodes} --attempt "$ATTEMPT" '
        '--started-at "$ATTEMPT_STARTED_AT" --exit-code "$code" --partition "$SLURM_JOB_PARTITION" '
        '--alloc-tres "$ALLOC_TRES" --node-cpus "$NODE_CPUS" 2>&1 '
        "| sed 's/^/[job] /'",
        *on_finish,
        f"  {' '.join(upload)} 2>&1 | sed 's/^/[job] /' || echo '[job] results upload incomplete: see status.json'",
        '  exit "$code"',
        "}",
    ]


def _gate(spec: JobSpec) -> ScriptLines:
    """The nodes measured before anything else (dtrain/jobs/node_gate.py), in the training environment."""
    if spec.gate is None or not spec.gated:
        return ScriptLines()
    runner = _user_runner(replace(spec, image=spec.gate_image or spec.image))
    return node_gate.script_lines(spec.gate, spec.nodes, runner, q(spec.python), keeps_secrets=bool(spec.secrets))


def _local_copy(copy: LocalCopy | None) -> ScriptLines:
    """One nvme-copy per node (resumable: a requeued attempt finishes what the last one began); any failure
    ends the job before training starts."""
    if copy is None:
        return ScriptLines()
    tool = f'"$PY" "$TOOLS/nvme_copy.py" --source {q(copy.source)} --dest {q(copy.dest)}'
    said = q(f"[job] the local copy of {copy.source} failed: training not started")
    failed = f"{time_warning.AT_THE_LIMIT}; echo {said}; exit 1"
    lines = [
        f"echo {q(f'[job] copying {copy.source} to {copy.dest} on every node (--local-copy)')}",
        f"run_step srun --label --overlap --kill-on-bad-exit=1 {ONE_TASK_PER_NODE} {tool} || {{ {failed}; }}",
    ]
    return ScriptLines(before_launch=lines, runs_steps=True)


def _launch(spec: JobSpec) -> list[str]:
    annotate = (
        f'"$PY" "$TOOLS/annotate_output.py" --launcher {spec.launcher} --hosts "$HOSTS" '
        f'--slots {spec.processes_per_node} --logs-dir "$RUN_DIR/logs" --verdict "$RUN_DIR/verdict.json"'
        + task_steps.secrets_mask_flag(spec)
    )
    if spec.mode == "per-node":
        *setup, launcher = _per_node_lines(spec)
    else:
        *setup, launcher = _horovod_lines(spec) if spec.launcher == "horovodrun" else _torchrun_lines(spec)
    # in the background, so that a TERM from scancel is handled at once, not when the pipeline ends
    launch = [*setup, f"{launcher} 2>&1 | {annotate} &", "STEP_PID=$!"]
    every_node = f"srun --overlap --quiet {ONE_TASK_PER_NODE} {IGNORING_USR1}"  # the warning's forwarder
    warning = time_warning.trap(spec.warn_before_s, every_node, _container() if spec.image else None, spec.python)
    return [*launch, *warning, *time_warning.wait_for_launch()]


def _horovod_lines(spec: JobSpec) -> list[str]:
    hostfile = f'awk \'{{print $1 " slots={spec.processes_per_node}"}}\' "$RUN_DIR/nodes" >"$RUN_DIR/hostfile"'
    argv = ["horovodrun", "--gloo", "-np", str(spec.world_size), "--hostfile", f"{spec.run_dir}/hostfile"]
    argv += ["--disable-cache", "--start-timeout", "120"]
    # one node: horovodrun looks for the interface with 127.0.0.1 among those named, and finds none
    if spec.network_interface and spec.nodes > 1:
        argv += ["--network-interface", spec.network_interface]
    if spec.image:
        argv += ["-p", str(CONTAINER_SSH_PORT)]
    run = " ".join(_word(arg) for arg in [*argv, *task_steps.user_command(spec, spec.command)])
    if not spec.image:
        bindir = spec.python.rsplit("/", 1)[0] if "/" in spec.python else ""
        path = '"$TOOLS/bin:' + (f"{bindir}:" if bindir else "") + '$PATH"'
        shim = 'mkdir -p "$TOOLS/bin" && ln -sf ../srun_ssh.py "$TOOLS/bin/ssh"'
        return [hostfile, shim, f"cd {q(spec.workdir)} || exit 1", f"PATH={path} {run}"]
    inside = f"{IGNORE_USR1} cd {q(spec.workdir)} && {run}"
    return [hostfile, *_containers(spec), f"docker exec {_container()} sh -c {q(inside)}"]


def _torchrun_lines(spec: JobSpec) -> list[str]:
    prefix = f"export {TORCHRUN_PREFIX}"
    argv = ["torchrun", "--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.processes_per_node)]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", '"$RDZV"', "--rdzv-id", '"$SLURM_JOB_ID"', "--tee", "3"]
    argv += ["--no-python"]  # the command starts with the interpreter (or a .py entry point run by it)
    run = " ".join(_word(arg) for arg in [*argv, *task_steps.user_command(spec, spec.command)])
    rdzv = f'RDZV="$(head -n1 "$RUN_DIR/nodes"):$(({RDZV_PORT_BASE} + SLURM_JOB_ID % 1000))" && export RDZV'
    step = f"srun --label --overlap --kill-on-bad-exit=1 {ONE_TASK_PER_NODE}"
    if not spec.image:
        bindir = spec.python.rsplit("/", 1)[0] if "/" in spec.python else ""
        path = f'PATH="{bindir}:$PATH" ' if bindir else ""
        return [prefix, rdzv, f"cd {q(spec.workdir)} || exit 1", f"{step} {IGNORING_USR1} env {path}{run}"]
    docker = " ".join(_docker_run(spec, detach=False))
    # docker run passes the signals it gets on to the container's first process: that shell ignores USR1
    return [prefix, rdzv, f"{step} {docker} sh -c {q(f'{IGNORE_USR1} cd {q(spec.workdir)} && {run}')}"]


def _per_node_lines(spec: JobSpec) -> list[str]:
    """Per-node mode: the user's command (their own launcher) once per node, in the code directory."""
    port = f"{RDZV_PORT_BASE} + SLURM_JOB_ID % 1000"
    *exports, run = task_steps.per_node_lines(spec, EVERY_NODE_STEP, _user_runner(spec), port)
    cd = [] if spec.image else [f"cd {q(spec.workdir)} || exit 1"]
    return [f"export {TORCHRUN_PREFIX}", *exports, *cd, run]


def _user_runner(spec: JobSpec) -> list[str]:
    """What starts the user's own command on a node (setup, per-node mode): the training environment's
    bin first on PATH on the host runtime; the job's image, in the code directory, on the docker runtime."""
    if not spec.image:
        bindir = spec.python.rsplit("/", 1)[0] if "/" in spec.python else ""
        return [IGNORING_USR1, "env", *([f'PATH="{bindir}:$PATH"'] if bindir else [])]
    inside = f'{IGNORE_USR1} cd {q(spec.workdir)} && exec "$@"'
    return [*_docker_run(spec, detach=False), "sh", "-c", q(inside), "dtrain-run"]


def _containers(spec: JobSpec) -> list[str]:
    """Docker + horovodrun: an sshd in each node's container, on a key made for this run, carries
    horovodrun's remote workers between containers (Slurm's srun is not inside the image)."""
    keys = (
        'ssh-keygen -q -t ed25519 -N "" -f "$RUN_DIR/ssh/id_ed25519" && '
        'ssh-keygen -q -t ed25519 -N "" -f "$RUN_DIR/ssh/host_ed25519" && '
        'cp "$RUN_DIR/ssh/id_ed25519.pub" "$RUN_DIR/ssh/authorized_keys"'
    )
    sshd = (
        "mkdir -p /root/.ssh /run/sshd && "
        'install -m 600 "$RUN_DIR/ssh/id_ed25519" /root/.ssh/id_ed25519 && '
        f"printf 'Host *\\n Port {CONTAINER_SSH_PORT}\\n StrictHostKeyChecking no\\n UserKnownHostsFile /dev/null\\n' "
        ">/root/.ssh/config && "
        f'exec /usr/sbin/sshd -D -e -p {CONTAINER_SSH_PORT} -h "$RUN_DIR/ssh/host_ed25519" '
        '-o AuthorizedKeysFile="$RUN_DIR/ssh/authorized_keys" -o PermitRootLogin=prohibit-password '
        "-o PasswordAuthentication=no -o UsePAM=no -o StrictModes=no"
    )
    start = " ".join(_docker_run(spec, detach=True))
    return [
        f'mkdir -p "$RUN_DIR/ssh" && {keys} || exit 1',
        f"srun --overlap {ONE_TASK_PER_NODE} {start} sh -c {q(sshd)} || exit 1",
    ]


def _docker_run(spec: JobSpec, detach: bool) -> list[str]:
    argv = ["docker", "run", "--rm", "--name", _container(), "--label", '"slurm.job=$SLURM_JOB_ID"']
    argv += ["--network", "host", "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
    argv += ["--cap-add", "IPC_LOCK", "-v", f"{q(spec.shared_mount)}:{q(spec.shared_mount)}"]
    if spec.local_copy:
        argv += ["-v", f"{q(spec.local_copy.dest)}:{q(spec.local_copy.dest)}:ro"]
    # the launch line inside is single-quoted: the variables it names come in through the environment
    argv += ["-e", "RUN_DIR", "-e", "RUN_ID", "-e", "GIT_REVISION", "-e", "RDZV", "-e", "SLURM_JOB_ID"]
    argv += ["-e", "OUTPUT_DIR", "-e", "CHECKPOINT_DIR", "-e", "SLURM_NODEID"]  # the node's index: the gate's
    argv += ["-e", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"]
    if spec.tracking:
        argv += [arg for key in tracking.CONTAINER_ENV for arg in ("-e", key)]
    argv += [arg for key in ("PYTHONUNBUFFERED", *spec.env, *task_steps.docker_env(spec)) for arg in ("-e", key)]
    if spec.infiniband:
        argv += ["--device", "/dev/infiniband"]
    if topology := spec.env.get("NCCL_TOPO_FILE"):
        # the HPC image's topology file (infra/skus.py) is on the node, not in the image: without it
        # NCCL reads sysfs, which on Hyper-V lacks the real PCI layout
        argv += ["-v", f"{q(topology)}:{q(topology)}:ro"]
    if detach:
        argv.insert(2, "-d")
    if spec.gpus_per_node:
        # only the GPUs Slurm gave the job on this node (gres), read on the node itself: the container
        # sees no other job's devices
        argv[:2] = [DOCKER_RUN_WITH_JOB_GPUS]
    return [*argv, q(spec.image)]


def _container() -> str:
    return '"hvd-$SLURM_JOB_ID"'


def _word(arg: str) -> str:
    """A word of a launch line: quoted, but the script's own "$VARIABLES" stay expandable."""
    return arg if arg.startswith('"$') else q(arg)


def _epilogue(requeue: list[str]) -> list[str]:
    """The job's status: the failed rank's own exit status where one failed (a launcher says only 1)."""
    read = "import json, sys; print(json.load(open(sys.argv[1]))['exit_code_of_failed_rank'] or '')"
    return [
        "code=$?",
        f'rank_code=$("$PY" -c {q(read)} "$RUN_DIR/verdict.json" 2>/dev/null)',
        'if [ "$code" -ne 0 ] && [ -n "$rank_code" ]; then code=$rank_code; fi',
        *requeue,
        'exit "$code"',
    ]


def _requeue_on_node_failure(keeps_secrets: bool) -> list[str]:
    """--requeue: Slurm requeues a job whose node it finds dead (after SlurmdTimeout), but the ranks see
    a lost peer within seconds and end the job first. So when the launch fails, ask every node of the
    allocation for an empty job step; if one cannot run it, requeue the job ourselves: it runs again
    once enough nodes are back, and resumes from its checkpoints."""
    step = 'srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" true </dev/null >/dev/null 2>&1'
    probe = f"timeout {NODE_PROBE_S} {step}"
    return [
        f'if [ "$code" -ne 0 ] && [ "$code" -ne {PREEMPTED_EXIT_CODE} ]; then  # preempted: the Spot agent requeues',
        "  while read -r node; do",
        f"    {probe} && continue",
        '    echo "[job] node $node does not answer: requeueing the job (--requeue)"',
        *(["    REQUEUED=1  # finish() keeps the secrets for the next attempt"] if keeps_secrets else []),
        '    scontrol requeue "$SLURM_JOB_ID" && { sleep infinity & wait $!; }  # Slurm ends this attempt',
        '  done <"$RUN_DIR/nodes"',
        "fi",
    ]
