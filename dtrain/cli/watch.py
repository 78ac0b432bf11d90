"""Watch a run while it runs: `ui` (the cluster's MLflow, TensorBoard and Prometheus through SSH tunnels) and
`top` (a live terminal view of the running jobs and the GPUs). Thin verbs over dtrain/cluster/tunnels.py and
dtrain/jobs/top.py."""

from __future__ import annotations

import argparse
import subprocess
import time

from rich.console import Group
from rich.live import Live

from dtrain.cli.jobs import slurm_seconds
from dtrain.cli_entry import add_cluster_option, int_between
from dtrain.cluster.description import ClusterDescription, load
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH
from dtrain.cluster.tunnels import free_remote_port, open_tunnels, services, session_ssh, tensorboard_command
from dtrain.errors import ExitCode
from dtrain.jobs.top import render, take_snapshot
from dtrain.jobs.tracking import experiment_page
from dtrain.processes import stop_pids
from dtrain.ui import make_console

console = make_console()
out = make_console(stderr=False)


def configure(commands: argparse._SubParsersAction) -> None:
    ui = commands.add_parser(
        "ui",
        help="open the cluster's MLflow, TensorBoard and Prometheus on this machine (SSH tunnels), until Ctrl-C",
        description="Open SSH tunnels (through the jump host) from local ports to the cluster's MLflow server, "
        "Prometheus and a TensorBoard over every run, print their local URLs, and keep them open until Ctrl-C. "
        "Nothing of them is reachable from outside the cluster's network otherwise.",
        epilog="example: python -m dtrain ui (then open the printed URLs in a browser).",
    )
    top = commands.add_parser(
        "top",
        help="a live view of the running jobs (step, loss, throughput, time left) and the GPUs",
        description="Refresh every few seconds: each running job's step, loss, images/s and time left (from its "
        "log), and each node's GPU utilisation and memory (from Prometheus). Ctrl-C quits.",
        epilog="examples: python -m dtrain top; python -m dtrain top --once (one frame, for scripts).",
    )
    top.add_argument("--interval", type=int_between(1, 3600), default=5, help="seconds between refreshes (%(default)s)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    for parser, handler in ((ui, run_ui), (top, run_top)):
        add_cluster_option(parser)
        parser.set_defaults(handler=handler)


def run_top(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    with SSH(desc) as ssh:
        slurm = Slurm(desc, ssh)

        def frame() -> Group:
            snapshot = take_snapshot(desc, slurm)
            return render(snapshot, {job.job_id: slurm_seconds(job.elapsed) for job, _ in snapshot.jobs})

        if args.once:
            out.print(frame())
            return 0
        try:
            with Live(frame(), console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(args.interval)
                    live.update(frame(), refresh=True)
        except KeyboardInterrupt:
            return 0


def run_ui(args: argparse.Namespace) -> int:
    desc = load(args.cluster)
    started: list[subprocess.Popen] = []
    with SSH(desc) as ssh:
        try:
            board = _start_tensorboard(desc, ssh, started)
            tunnel, urls = open_tunnels(ssh, services(desc, board))
            started.append(tunnel)
            if "MLflow" in urls:  # the runs of this cluster's experiment, in MLflow's model-training view
                urls["MLflow"] = experiment_page(urls["MLflow"], desc.name)
            for name, url in urls.items():
                out.print(f"{name:12} {url}")
            if board is None:
                out.print("TensorBoard  not served on this cluster: `dtrain results RUN` brings a run's event files")
            console.print("[dim]tunnels open; Ctrl-C closes them[/dim]")
            while tunnel.poll() is None:
                time.sleep(1)
            console.print("[red]the SSH tunnels closed[/red]")
            return int(ExitCode.FAILED)
        except KeyboardInterrupt:
            return 0
        finally:
            stop_pids([proc.pid for proc in started if proc.poll() is None])


def _start_tensorboard(desc: ClusterDescription, ssh: SSH, started: list[subprocess.Popen]) -> int | None:
    """TensorBoard on the login host for this session (ssh -tt: it ends with the session); its port there."""
    port = free_remote_port(ssh) if desc.runtime.kind == "host" else None
    command = tensorboard_command(desc, port) if port else None
    if command is None:
        return None
    argv = [*session_ssh(ssh), "-tt", ssh.login.alias, command]
    started.append(
        subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
    )
    return port
