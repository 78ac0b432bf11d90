"""Local SGD over a slow link: the time every-step, local-sgd and hierarchical take to
reach the synchronous run's final loss, between 2 nodes of the local cluster, 2 processes each, at
full speed and with the nodes' links slowed to 100 Mbit/s (`local link-rate`, tc tbf).

  .venv-train/bin/python -m bench.cpu.local_sgd      # ~3 min, as root; also a section of `make bench`

Per link rate, in one cluster: the synchronous run (``--sync every-step``) trains ``steps`` steps;
its final loss is the target. Each periodic mode (``--sync-every`` H), with the plain average and
with DiLoCo's outer Nesterov step, then trains from the same weights until its global model,
evaluated every H steps, is at or below the target.
The figure is the synchronous run's training time over the periodic run's (higher is better): the
acceptance is at least 1/0.6 at 100 Mbit/s (at most 0.6x the time) and at least 0.95 at full
speed (not slower by more than 5%). Writes ``local_sgd.json`` and ``local_sgd.png`` (the loss
against the training time) into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import proc
from bench.harness.results import Figure, markdown_table

WORKER = "bench.cpu.local_sgd_worker"
FULL_SPEED, SLOW = "full", "100mbit"
RATES = (FULL_SPEED, SLOW)
EVERY_STEP = "every-step"
PERIODIC = ("local-sgd", "local-sgd+nesterov", "hierarchical", "hierarchical+nesterov")  # +nesterov: DiLoCo
GOALS = {FULL_SPEED: 0.95, SLOW: 1 / 0.6}  # synchronous time over periodic time
NODES, PROCS_PER_NODE = 2, 2
RUN_TIMEOUT_S = 300
SUBNETS = tuple(f"10.219.{third}.0/24" for third in range(0, 250, 10))


@dataclass(frozen=True)
class Shape:
    steps: int = 48  # the synchronous run's; the periodic ones stop at the target or 2x this
    every: int = 8  # H, and the steps between two evaluations in every mode
    lr: float = 0.1
    batch_size: int = 32


QUICK = Shape(steps=16, every=4)


def time_to_target(evals: Sequence[Sequence[float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or below ``target``; None if none is."""
    for _done, seconds, loss in evals:
        if loss <= target:
            return seconds
    return None


def figures(runs: dict[str, dict[str, list[list[float]]]], shape: Shape) -> list[Figure]:
    """``runs[rate][mode]``: a run's evaluations ``[steps done, seconds, loss]``."""
    result = []
    for rate in RATES:
        synchronous = runs[rate][EVERY_STEP]
        target, baseline = synchronous[-1][2], synchronous[-1][1]
        for mode in PERIODIC:
            key = f"local_sgd_{mode.replace('-', '_').replace('+', '_')}_{rate}"  # e.g. local_sgd_hierarchical_100mbit
            outer = "DiLoCo outer Nesterov step" if mode.endswith("+nesterov") else "plain average"
            title = (
                f"Time to the synchronous loss ({target:.3f}), 2 nodes x {PROCS_PER_NODE} processes, "
                f"links at {rate}: {mode.partition('+')[0]} every {shape.every} steps ({outer}) vs every-step"
            )
            reached = time_to_target(runs[rate][mode], target)
            if reached is None:
                done = int(runs[rate][mode][-1][0])
                result.append(Figure.skipped(key, title, f"{mode} did not reach {target:.3f} in {done} steps"))
                continue
            steps = next(int(done) for done, _s, loss in runs[rate][mode] if loss <= target)
            result.append(
                Figure(
                    key,
                    title,
                    "s",
                    reached,
                    baseline,
                    baseline / reached,
                    goal=GOALS[rate],
                    ours_label=f"{mode}, {steps} steps",
                    baseline_label=f"every-step, {shape.steps} steps",
                    note="ratio: every-step's training time over this mode's (time excludes evaluation)",
                )
            )
    return result


class LocalCluster:
    """A 2-node local cluster of this run's own, brought up and down with the operator CLI."""

    def __init__(self, ops_python: Path, state_dir: Path) -> None:
        self.ops_python, self.state_dir = ops_python, state_dir
        self.nodes: list[dict[str, Any]] = []

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [str(self.ops_python), "-m", "dtrain", "local", *args, "--state-dir", str(self.state_dir)]
        return subprocess.run(cmd, cwd=proc.REPO_ROOT, capture_output=True, text=True, timeout=180, check=False)

    def up(self) -> None:
        name = f"bsgd{os.getpid() % 10000}"
        for subnet in SUBNETS:  # `up` refuses a range this machine already uses, before creating anything
            done = self.cli("up", "--nodes", str(NODES), "--name", name, "--subnet", subnet)
            if done.returncode == 0:
                state = json.loads((self.state_dir / "state.json").read_text())
                self.nodes = state["nodes"]
                return
            if "already in use" not in done.stderr and "overlaps" not in done.stderr:
                break
        raise proc.BenchError(f"local up failed: {(done.stderr or done.stdout).strip()[-2000:]}")

    def link_rate(self, rate: str) -> None:
        done = self.cli("link-rate", rate)
        if done.returncode != 0:
            raise proc.BenchError(f"local link-rate {rate} failed: {done.stderr.strip()}")

    def down(self) -> None:
        self.cli("down")

    def train(self, run: int, flags: Sequence[str]) -> dict[str, list[list[float]]]:
        """The worker on both nodes (torchrun per node, in its namespace): every mode's evaluations."""
        out = self.state_dir / "shared" / f"local-sgd-{run}.json"
        master = ["--master-addr", self.nodes[0]["address"], "--master-port", str(29500 + run)]
        env = proc.thread_env(1, {"GLOO_SOCKET_IFNAME": "eth0"})
        logs = [self.state_dir / f"run-{run}-node-{rank}.log" for rank in range(NODES)]
        agents = []
        for rank, (node, log) in enumerate(zip(self.nodes, logs, strict=True)):
            cmd = ["ip", "netns", "exec", node["namespace"], sys.executable, "-m", "torch.distributed.run"]
            cmd += ["--nnodes", str(NODES), "--nproc-per-node", str(PROCS_PER_NODE), "--node-rank", str(rank)]
            cmd += [*master, "-m", WORKER, *flags, "--metrics-json", str(out)]
            with open(log, "w") as sink:
                agents.append(
                    subprocess.Popen(cmd, cwd=proc.REPO_ROOT, env=env, stdout=sink, stderr=sink, start_new_session=True)
                )
        try:
            codes = [agent.wait(timeout=RUN_TIMEOUT_S) for agent in agents]
        except subprocess.TimeoutExpired:
            codes = [-1]
        finally:
            for agent in agents:  # its own session: the agent and its workers
                if agent.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        if any(codes) or not out.is_file():
            raise proc.BenchError(f"{WORKER} {' '.join(flags)} failed ({codes}):\n{logs[0].read_text()[-2000:]}")
        return json.loads(out.read_text())["runs"]


@contextlib.contextmanager
def local_cluster(ops_python: Path) -> Iterator[LocalCluster]:
    with tempfile.TemporaryDirectory(prefix="bench-local-sgd-") as tmp:
        cluster = LocalCluster(ops_python, Path(tmp) / "cluster")
        try:
            cluster.up()
            yield cluster
        finally:
            cluster.down()


def run_all(ops_python: Path, shape: Shape) -> dict[str, dict[str, list[list[float]]]]:
    flags = ["--steps", str(shape.steps), "--every", str(shape.every), "--lr", str(shape.lr)]
    flags += ["--batch-size", str(shape.batch_size), "--periodic", *PERIODIC]
    runs: dict[str, dict[str, list[list[float]]]] = {}
    with local_cluster(ops_python) as cluster:
        for index, rate in enumerate(RATES):
            cluster.link_rate(rate)
            runs[rate] = cluster.train(index, flags)
    return runs


def write_png(runs: dict[str, dict[str, list[list[float]]]], path: Path) -> None:
    """Loss of the global model against training time, one panel per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATES), figsize=(12, 4.5), sharey=True)
    for axis, rate in zip(axes, RATES, strict=True):
        target = runs[rate][EVERY_STEP][-1][2]
        for mode, evals in runs[rate].items():
            axis.plot([e[1] for e in evals], [e[2] for e in evals], marker=".", label=mode)
        axis.axhline(target, color="grey", linestyle=":", label="target: every-step's final loss")
        axis.set_title(f"2 nodes x {PROCS_PER_NODE} processes, links at {rate}")
        axis.set_xlabel("training time (s)")
        axis.legend()
    axes[0].set_ylabel("global model's loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def measure(ops_python: Path, out: Path, quick: bool = False) -> list[Figure]:
    """The section of ``python -m bench``: the figures, with local_sgd.json and local_sgd.png in ``out``."""
    if os.geteuid() != 0:
        reason = "needs root for the local cluster's network namespaces"
        return [Figure.skipped("local_sgd", "Local SGD over a slow link", reason)]
    shape = QUICK if quick else Shape()
    runs = run_all(ops_python, shape)
    result = figures(runs, shape)
    (out / "local_sgd.json").write_text(
        json.dumps({"shape": asdict(shape), "runs": runs, "figures": [f.to_json() for f in result]}, indent=2) + "\n"
    )
    write_png(runs, out / "local_sgd.png")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu.local_sgd", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (a smoke test, not numbers)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parents[1] / "results", help="where local_sgd.* go (bench/results/)"
    )
    parser.add_argument(
        "--ops-python", type=Path, default=proc.REPO_ROOT / ".venv" / "bin" / "python", help="runs `dtrain local`"
    )
    args = parser.parse_args(argv)
    result = measure(args.ops_python, args.out, args.quick)
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
