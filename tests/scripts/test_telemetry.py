"""Telemetry on the local cluster (dtrain/local/telemetry.py): the real Prometheus holds node_exporter's
series for every node and the emulated GPUs' DCGM series (dtrain/local/gpu_exporter.py); a job whose
ranks are stopped (SIGSTOP) reads 0 % on its GPUs and `jobs` marks it idle within the window. A job's GPU
series carry its id (hpc_job, from Slurm's prolog), its MLflow run charts its nodes' system metrics beside
its loss, which MLflow's UI shows in headless Chromium (driven by Playwright), and `top` reads the
progress of the user's own code from that run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from dtrain.cluster.description import ClusterDescription
from dtrain.cluster.telemetry import GpuActivity, parse_indices, parse_job_gpus
from dtrain.jobs.progress import progress_from_mlflow
from dtrain.local import gpu_exporter
from dtrain.local import power as local_power
from dtrain.local.state import load_state
from dtrain.local.telemetry import textfile_dir
from tests.polling import wait_for

from .conftest import FIXTURES, live_pids_mentioning, local_state_dir, own_cluster, start_module
from .test_launcher import cli, job_id_of, run_dir
from .test_mlflow import api, mlflow_run_of, server

IDLE_WINDOW_S = 10
SAMPLES_S = 120  # the system metrics' sampler logs every 10 s: a few of its samples on a loaded machine
PAGE_WAIT_S = 90  # MLflow's UI loads its scripts, then the run's metrics (two requests to a busy server)


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDescription]:
    """Two nodes of one emulated GPU each, with Prometheus and MLflow: shared by this module's tests."""
    with own_cluster(tmp_path_factory.mktemp("gpus"), "t", nodes=2, gpus_per_node=1) as desc:
        yield desc


def prometheus(desc: ClusterDescription, promql: str) -> list[dict]:
    assert desc.telemetry is not None
    url = f"{desc.telemetry.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.load(answer)["data"]["result"]


def gpu_util(desc: ClusterDescription) -> dict[str, float]:
    """node -> its GPU 0's utilisation, as Prometheus has it now."""
    return {r["metric"]["node"]: float(r["value"][1]) for r in prometheus(desc, 'DCGM_FI_DEV_GPU_UTIL{gpu="0"}')}


def job_row(cluster_file: Path, job: str) -> dict | None:
    proc = cli("jobs", "--cluster", str(cluster_file), "--json", "--idle-window", str(IDLE_WINDOW_S))
    assert proc.returncode == 0, proc.stderr
    return next((row for row in json.loads(proc.stdout)["jobs"] if row["job"] == job), None)


def ranks_of(run_id: str) -> list[int]:
    """The job's ranks (every node's: the host sees all of them): the run's processes that are the python of
    `python busy.py` (its batch script, srun and torchrun name busy.py too)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        python = Path(argv[0].decode()).name.startswith("python")
        script = [arg for arg in argv[1:] if not arg.startswith(b"-")][:1] == [b"busy.py"]
        if f"RUN_ID={run_id}".encode() in environ and python and script:
            found.append(int(entry.name))
    return found


def test_prometheus_holds_every_node_and_gpu_and_jobs_marks_a_stopped_job_idle(gpu_cluster):
    desc = gpu_cluster
    cluster_file = local_state_dir(desc) / "cluster.json"
    nodes = {"node-0", "node-1"}
    up = 'up{exporter="node_exporter"} == 1'
    wait_for(lambda: {r["metric"]["node"] for r in prometheus(desc, up)} == nodes, 30, "node_exporter on every node")
    cpu = prometheus(desc, 'count by (node) (node_cpu_seconds_total{mode="idle"})')
    assert {r["metric"]["node"] for r in cpu} == nodes
    series = wait_for(lambda: prometheus(desc, "DCGM_FI_DEV_GPU_UTIL"), 30, "the emulated GPUs' series")
    assert {(r["metric"]["node"], r["metric"]["gpu"], r["metric"]["emulated"]) for r in series} == {
        ("node-0", "0", "1"),
        ("node-1", "0", "1"),
    }
    for name in (
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_XID_ERRORS",
    ):
        assert len(prometheus(desc, name)) == 2, name

    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(FIXTURES / "busy"), "--nodes", "2"]
    proc = cli(*launch, "--gpus", "2", "--run-id", "busy", "--detach", "--", "python", "busy.py", "300")
    assert proc.returncode == 0, proc.stderr
    job = wait_for(lambda: (row := job_row(cluster_file, "1")) and row["state"] == "RUNNING" and row, 60, "job")
    # busy ranks: their GPUs read busy, and the job is not idle once it has run a whole window
    wait_for(lambda: all(v > 0 for v in gpu_util(desc).values()), 30, "both GPUs busy")
    busy = wait_for(
        lambda: (row := job_row(cluster_file, job["job"]))["gpus_idle"] is not None and row, 60, "a verdict"
    )
    assert busy["gpus_idle"] is False, busy
    # `top --once`: the job's last logged step and the GPUs' readings
    frame = wait_for(lambda: re.search(r"\b\d+/300\b", (t := top(cluster_file))) and t, 60, "a step in top")
    assert re.search(r"node-0 +│ 0 +│ +\d+ %", frame) and re.search(r"node-1 +│ 0", frame), frame
    ranks = ranks_of("busy")
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: set(gpu_util(desc).values()) == {0.0}, 20, "both GPUs at 0 %")
    # within the window (and a scrape or two) of the stop, `jobs` marks it
    wait_for(lambda: job_row(cluster_file, job["job"])["gpus_idle"], IDLE_WINDOW_S + 20, "the job marked idle")
    table = cli("jobs", "--cluster", str(cluster_file), "--idle-window", str(IDLE_WINDOW_S))
    assert "GPUs idle" in table.stdout, table.stdout
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    assert cli("cancel", "--cluster", str(cluster_file), job["job"]).returncode == 0

    # an XID error on node-1's GPU (the stand-in's report of the driver's): `status` names the node
    (textfile_dir(load_state(local_state_dir(desc)), "node-1") / "xid-0").write_text("79\n")
    alerts = wait_for(lambda: node_alerts(cluster_file).get("node-1"), 30, "node-1's XID in status")
    assert alerts == ["gpu 0: XID 79"] and node_alerts(cluster_file)["node-0"] == []

    # `ui`: local URLs through SSH tunnels, Prometheus, TensorBoard and MLflow answering there, until Ctrl-C
    ui = start_module("dtrain", "ui", "--cluster", str(cluster_file), interruptible=True)
    try:
        urls = dict(wait_for(lambda: ui_urls(ui), 60, "the UI's URLs"))
        assert set(urls) == {"MLflow", "TensorBoard", "Prometheus"}
        assert all(url.startswith("http://127.0.0.1:") for url in urls.values())
        with urllib.request.urlopen(urls["Prometheus"] + "-/ready", timeout=10) as answer:
            assert answer.status == 200
        wait_for(lambda: answers(urls["TensorBoard"]), 120, "TensorBoard through its tunnel", interval=1)
        mlflow_base, _, page = urls["MLflow"].partition("#")  # the cluster's runs, in the model-training view
        assert page.endswith("?workflowType=machine_learning"), urls["MLflow"]
        wait_for(lambda: answers(mlflow_base + "health"), 120, "MLflow through its tunnel", interval=1)
    finally:
        ui.send_signal(signal.SIGINT)
        assert ui.wait(timeout=30) == 0
    assert not live_pids_mentioning("tensorboard.main")

    # a node switched off and on again (power saving) comes back with its exporters
    state_dir = local_state_dir(desc)
    local_power.stop_node(state_dir, "node-1")
    local_power.start_node(state_dir, "node-1")
    wait_for(lambda: len(prometheus(desc, up)) == 2 and len(gpu_util(desc)) == 2, 30, "node-1's exporters again")


def test_a_jobs_gpus_carry_its_id_and_its_mlflow_run_charts_them_beside_its_loss(gpu_cluster):
    """Two jobs of the user's own code, one GPU each (one per node): Prometheus answers {hpc_job=ID} with that
    job's GPU only; the watched one, which logs its loss to MLflow and no step line, gets its node's GPU,
    CPU and network in its run (its neighbour's GPU not), MLflow's UI draws both charts with points in the
    model-training view, and `top` shows its step and loss from the run."""
    desc = gpu_cluster
    cluster_file = local_state_dir(desc) / "cluster.json"
    uri = server(desc)  # started, not waited for, by `up`: a job launched before it answers runs untracked
    launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(FIXTURES / "busy"), "--gpus", "1", "--detach"]
    jobs = {}
    for run_id, logging in (("watched", ["mlflow"]), ("neighbour", [])):
        proc = cli(*launch, "--run-id", run_id, "--", "python", "busy.py", "300", *logging)
        assert proc.returncode == 0, proc.stderr
        jobs[run_id] = job_id_of(proc)
    try:
        by_job = {
            run_id: wait_for(lambda job=job: gpu_series(desc, job), 60, f"job {job}'s GPU series")
            for run_id, job in jobs.items()
        }
        assert all(len(series) == 1 for series in by_job.values()), by_job  # one job's GPU, one series
        watched_node, neighbour_node = by_job["watched"][0], by_job["neighbour"][0]
        assert watched_node != neighbour_node, by_job

        run = mlflow_run_of(desc, "watched")
        gpu_key = f"system/{watched_node}/gpu_0_utilization_percentage"
        wait_for(lambda: len(history(uri, run, gpu_key)) >= 2 and len(history(uri, run, "loss")) >= 2, SAMPLES_S, "")
        info = api(uri, "runs/get", run_id=run)["run"]
        keys = {metric["key"] for metric in info["data"]["metrics"]}
        for name in ("cpu_utilization_percentage", "network_receive_megabytes", "gpu_0_memory_usage_megabytes"):
            assert f"system/{watched_node}/{name}" in keys, keys
        assert not [key for key in keys if key.startswith(f"system/{neighbour_node}/gpu")], keys  # not its GPU
        tags = {tag["key"]: tag["value"] for tag in info["data"]["tags"]}
        assert tags["slurm.job_id"] == jobs["watched"] and tags["mlflow.user"] and tags["dtrain.framework"]
        experiment = api(uri, "experiments/get", experiment_id=info["info"]["experiment_id"])["experiment"]
        assert experiment["name"] == desc.name  # the experiment is the cluster's
        log = (run_dir(desc, "watched") / "output.log").read_text()
        page = f"{uri}/#/experiments/{experiment['experiment_id']}/runs/{run}"
        assert f"MLflow run {run} at {page}?workflowType=machine_learning" in log, log[-2000:]

        with sync_playwright() as playwright:  # Debian's chromium: Playwright's own browser is never fetched
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            try:
                view = browser.new_page(viewport={"width": 1400, "height": 1000})
                assert chart_points(view, f"{page}/model-metrics?workflowType=machine_learning", "loss") >= 2
                system = f"{page}/system-metrics?workflowType=machine_learning"
                assert chart_points(view, system, "gpu_0_utilization_percentage") >= 2
            finally:
                browser.close()

        row = wait_for(lambda: top_row(cluster_file, jobs["watched"]), 60, "the watched job's step in top")
        # whose it is, its step (the total is not known) and loss, from MLflow
        assert re.fullmatch(r"root \d+ \d\.\d{4}", row), row
    finally:
        for job in jobs.values():
            cli("cancel", "--cluster", str(cluster_file), job)
    # the epilog takes the job's id off its GPU: the next scrape has no series of it
    wait_for(lambda: not gpu_series(desc, jobs["watched"]), 60, "the ended job's label gone")


def gpu_series(desc: ClusterDescription, job: str) -> list[str]:
    """The nodes of the GPU series labelled with the job's id."""
    return [r["metric"]["node"] for r in prometheus(desc, f'DCGM_FI_DEV_GPU_UTIL{{hpc_job="{job}"}}')]


def history(uri: str, run: str, key: str) -> list[dict]:
    return api(uri, "metrics/get-history", run_id=run, metric_key=key).get("metrics", [])


def chart_points(page: Page, url: str, title: str) -> int:
    """The points of the run's chart named ``title`` on the page at ``url`` (plotly draws each as a path)."""
    page.goto(url)
    card = page.locator('[data-testid="experiment-view-compare-runs-card"]').filter(has_text=title)
    points = card.locator(".scatterlayer .point")
    points.first.wait_for(state="attached", timeout=PAGE_WAIT_S * 1000)
    return points.count()


def top_row(cluster_file: Path, job: str) -> str | None:
    """The job's user, step and loss cells in `top --once`, space-separated; None while it shows no step."""
    for line in top(cluster_file).splitlines():
        cells = [cell.strip() for cell in line.split("│")]  # job, run, user, nodes, step, loss, ...
        if len(cells) > 6 and cells[1] == job and cells[5] not in ("", "-"):
            return f"{cells[3]} {cells[5]} {cells[6]}"
    return None


def top(cluster_file: Path) -> str:
    proc = cli("top", "--cluster", str(cluster_file), "--once")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def node_alerts(cluster_file: Path) -> dict[str, list[str]]:
    proc = cli("status", "--cluster", str(cluster_file), "--json")
    return {node["name"]: node["gpu_alerts"] for node in json.loads(proc.stdout)["nodes"]}


def ui_urls(ui: subprocess.Popen) -> list[tuple[str, str]] | None:
    """The `name  URL` lines `ui` printed, once it printed all three (None before)."""
    found = []
    assert ui.stdout is not None
    while len(found) < 3:
        line = ui.stdout.readline()
        if not line:
            return None
        if match := re.fullmatch(r"(\w+) +(http://\S+)", line.strip()):
            found.append((match[1], match[2]))
    return found


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_the_gpu_stand_in_splits_cpu_time_over_the_gpus_a_process_holds():
    before = {(1, 10): gpu_exporter.Sample((0,), 5.0, 100.0), (2, 11): gpu_exporter.Sample((0, 1), 1.0, 200.0)}
    after = {**before, (1, 10): gpu_exporter.Sample((0,), 6.0, 100.0), (2, 11): gpu_exporter.Sample((0, 1), 3.0, 200.0)}
    readings = gpu_exporter.utilisation(before, after, 2.0, gpus=3)
    # GPU 0: 1 s of its own process and half of 2 s of the shared one, over 2 s; GPU 2: nobody's
    assert readings == {0: (100.0, 200.0), 1: (50.0, 100.0), 2: (0.0, 0.0)}
    assert gpu_exporter.held_gpus(b"A=1\0SLURM_JOB_GPUS=0,1\0SLURM_STEP_GPUS=1\0") == (1,)
    text = gpu_exporter.render("node-0", readings, {2: 79})
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="2",UUID="GPU-emulated-node-0-2"' in text and "stand-in" in text


def test_slurms_gpu_indices_per_node_decide_which_series_count():
    assert parse_indices("0,2-3") == [0, 2, 3]
    gpus = parse_job_gpus("7 node-0 0-1\n7 node-1 1\n")
    assert gpus == {"7": [("node-0", 0), ("node-0", 1), ("node-1", 1)]}
    activity = GpuActivity(600, {("node-0", 0): 0.0, ("node-0", 1): 3.0, ("node-1", 1): 60.0, ("node-1", 0): 0.0})
    assert activity.idle(gpus["7"]) is False  # one busy GPU: the job is working
    assert activity.idle([("node-0", 0), ("node-1", 0)]) is True
    assert activity.idle([("node-2", 0)]) is None  # no series: unknown, never "idle"


def test_top_reads_own_codes_step_and_loss_from_its_mlflow_runs_latest_metrics():
    metrics = [
        {"key": "system/node-0/gpu_0_utilization_percentage", "value": 80.0, "step": 900},  # not progress
        {"key": "train/loss", "value": 0.25, "step": 41},
        {"key": "accuracy", "value": 0.5, "step": 42},
    ]
    progress = progress_from_mlflow(json.dumps({"run": {"data": {"metrics": metrics}}}))
    assert progress is not None and (progress.step, progress.total_steps, progress.loss) == (42, None, 0.25)
    assert progress.eta_s(100) is None  # no total: no time left
    assert progress_from_mlflow(json.dumps({"run": {"data": {"metrics": metrics[:1]}}})) is None
    assert progress_from_mlflow("") is None and progress_from_mlflow('{"run": {"data": {}}}') is None
