"""The gate before every multi-node job: which thresholds hold on a cluster, and the batch script's lines.

A node can pass its health checks (GPUs there, ports ACTIVE) and still be the slowest rank of every
job: a link at a fraction of its rate, a throttled CPU. So before a job of two or more nodes trains,
its nodes measure themselves and each other in one short job step (dtrain/remote/job/node_gate.py:
a node figure, a link figure, an all-reduce across exactly the job's nodes) against the cluster's
thresholds (infra/health_thresholds.py). When a node fails, the job requeues itself and the nodes'
Epilog, which runs as root once the attempt ends, drains the failed node with its figure as the
reason (dtrain/remote/slurm/slurm-epilog.sh): Slurm then runs the job again on healthy nodes, from its
checkpoints. A job cannot drain a node itself (that is Slurm's administrators' right); the Epilog may,
and only the node it runs on, and only for a figure that node's own gate process wrote.

A gate that cannot measure (the image lacks torch, a node does not join in time) lets the job go on and
says so: the gate exists to keep time from being lost, not to add a way to lose it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.cluster.ssh import q
from dtrain.jobs.job_spec import ScriptLines
from infra.health_thresholds import LOCAL_HEALTH, NODE_HEALTH, GateThresholds

if TYPE_CHECKING:
    from dtrain.cluster.description import ClusterDescription

GATE_SUBDIR = "gate"  # <run>/gate: this attempt's figures, one file per node and summary.json
GATE_PORT_BASE = 30400  # the gate's rendezvous on the first node: this plus the job id modulo 1000
GATE_TIMEOUT_S = 180  # the whole step, torch's import on every node included; then the job goes on
GATE_FAILED = 3  # node_gate.py's exit status when a node failed
GATE_FRAMEWORK = "pytorch"  # whose image the gate runs in on the docker runtime, whatever the job's (it needs torch)


def gate_thresholds(desc: ClusterDescription) -> GateThresholds | None:
    """The cluster's gate thresholds: the local cluster's, or its GPU size's; None where none are known."""
    if desc.provider == "local":
        return LOCAL_HEALTH.gate
    health = NODE_HEALTH.get(desc.gpu_sku or "")
    return health.gate if health else None


def script_lines(gate: GateThresholds, nodes: int, runner: list[str], python: str, keeps_secrets: bool) -> ScriptLines:
    """The batch script's gate, before the launch: run once per node (runner: what starts the training
    python there), then go on, requeue the job without the failed nodes (keeps_secrets: for the next
    attempt), or go on after saying the gate could not measure."""
    requeue = requeue_lines(keeps_secrets)
    return ScriptLines(before_launch=_gate_lines(gate, nodes, runner, python, requeue), runs_steps=True)


def _gate_lines(gate: GateThresholds, nodes: int, runner: list[str], python: str, requeue: list[str]) -> list[str]:
    tool = [
        *runner,
        python,
        '"$TOOLS/node_gate.py"',
        '--out "$RUN_DIR/gate" --nodes-file "$RUN_DIR/nodes" --attempt "$ATTEMPT"',
        f'--port "$(({GATE_PORT_BASE} + SLURM_JOB_ID % 1000))"',
        f"--node-figure {gate.node_figure} --node-min {gate.node_min:g}",
        f"--link-min {gate.link_min_gbs:g} --job-min {gate.job_allreduce_min_gbs:g} --message-mib {gate.message_mib}",
    ]
    once_per_node = '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1'
    step = f"timeout -k 10 {GATE_TIMEOUT_S} srun --overlap --kill-on-bad-exit=0 {once_per_node}"
    said = q(f"[job] gate: measuring the {nodes} nodes before training (launch --no-gate skips this)")
    excluded = "import json, sys; print(', '.join(e['node'] for e in json.load(open(sys.argv[1]))['excluded']))"
    return [
        f"echo {said}",
        'rm -rf "$RUN_DIR/gate" && mkdir -p "$RUN_DIR/gate"',
        "GATE_STARTED=$SECONDS",
        f"run_step {step} {' '.join(tool)}",
        "GATE_STATUS=$?",
        'if [ "$GATE_STATUS" -eq 0 ]; then',
        '  echo "[job] gate: every node passed ($((SECONDS - GATE_STARTED)) s)"',
        f'elif [ "$GATE_STATUS" -eq {GATE_FAILED} ]; then',
        f'  EXCLUDED=$("$PY" -c {q(excluded)} "$RUN_DIR/gate/summary.json" 2>/dev/null)',
        '  echo "[job] gate: requeueing the job without ${EXCLUDED:-the failed nodes}: their Epilog drains them"',
        *(f"  {line}" for line in requeue),
        "else",
        '  echo "[job] gate: could not measure the nodes (status $GATE_STATUS): the job goes on without it"',
        "fi",
    ]


def requeue_lines(keeps_secrets: bool) -> list[str]:
    """Requeue this job and wait for Slurm to end the attempt. Slurm refuses to requeue a job launched
    without --requeue: the flag is set for the call, and put back as the attempt ends (the TERM trap)."""
    restore = 'scontrol update jobid="$SLURM_JOB_ID" requeue=0'
    return [
        *(["REQUEUED=1  # finish() keeps the secrets for the next attempt"] if keeps_secrets else []),
        'if scontrol show job "$SLURM_JOB_ID" | grep -q " Requeue=0"; then',
        '  scontrol update jobid="$SLURM_JOB_ID" requeue=1',
        f"  trap {q(restore + '; closing_on_term')} TERM",
        "fi",
        'scontrol requeue "$SLURM_JOB_ID" && { sleep infinity & wait $!; }  # Slurm ends this attempt',
        'echo "[job] gate: Slurm did not requeue the job: it goes on on these nodes"',
    ]
