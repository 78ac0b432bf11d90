"""The Spot pieces that need no cluster: the emulated metadata endpoint's protocol and platform, the price of
each attempt by its partition, and how `launch --spot` / `--spot-fallback` pick the partition."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.cluster.description import SlurmAccess, SSHEndpoint
from dtrain.errors import OperatorError
from dtrain.jobs.launch_request import LaunchRequest
from dtrain.jobs.submit import choose_partition
from dtrain.local import metadata as local_metadata
from dtrain.local.state import LocalState, NodeState
from tests.polling import wait_for

from .test_remote_tools import record_run

EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
REMOTE_BOOT = Path(__file__).resolve().parents[2] / "dtrain" / "remote" / "boot"


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[str]:
    """The node-0 endpoint of a cluster whose state is tmp_path, on a loopback port (not 169.254.169.254)."""
    server = local_metadata.MetadataServer(tmp_path, "node-0", address="127.0.0.1", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def ask(url: str, body: bytes | None = None, metadata: bool = True) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Metadata": "true"} if metadata else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_endpoint_speaks_scheduled_events_and_the_platform_evicts_once_acknowledged(tmp_path, endpoint):
    assert ask(endpoint + EVENTS, metadata=False)[0] == 400  # Azure's answer without the header
    assert ask(endpoint + "/metadata/scheduledevents")[0] == 400  # nor without an api-version
    assert ask(endpoint + "/metadata/instance/compute/name?api-version=2021-02-01&format=text") == (200, b"node-0")
    event_id = local_metadata.announce_preempt(tmp_path, "node-0")
    status, body = ask(endpoint + EVENTS)
    document = json.loads(body)
    [event] = document["Events"]
    assert status == 200 and document["DocumentIncarnation"] == 1
    assert (event["EventId"], event["EventType"], event["Resources"], event["EventStatus"]) == (
        event_id, "Preempt", ["node-0"], "Scheduled",
    )  # fmt: skip
    powered_off: list[str] = []
    local_metadata.evict_when_due(tmp_path, "node-0", lambda _, node: powered_off.append(node))
    assert powered_off == []  # neither acknowledged nor due: 30 s away
    assert ask(endpoint + EVENTS, json.dumps({"StartRequests": [{"EventId": event_id}]}).encode())[0] == 200
    assert json.loads(ask(endpoint + EVENTS)[1])["Events"][0]["EventStatus"] == "Started"
    local_metadata.evict_when_due(tmp_path, "node-1", lambda _, node: powered_off.append(node))
    assert powered_off == []  # another node's platform leaves it alone
    local_metadata.evict_when_due(tmp_path, "node-0", lambda _, node: powered_off.append(node))
    assert powered_off == ["node-0"] and json.loads(ask(endpoint + EVENTS)[1])["Events"] == []
    assert ask(endpoint + EVENTS, b"{}")[0] == 400  # an acknowledgement without StartRequests


def test_an_unacknowledged_preempt_evicts_at_its_not_before(tmp_path):
    local_metadata.announce_preempt(tmp_path, "node-1", notice_s=1)
    powered_off: list[str] = []
    time.sleep(1.1)
    local_metadata.evict_when_due(tmp_path, "node-1", lambda _, node: powered_off.append(node))
    assert powered_off == ["node-1"]


def dtrain_local(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtrain", "local", *args], capture_output=True, text=True, timeout=60)


def test_preempt_is_a_local_verb_that_announces_only_for_the_clusters_nodes(tmp_path):
    state = LocalState(name="hvd", mode="netns", state_dir=str(tmp_path), slurm_conf=str(tmp_path / "slurm.conf"))
    state.nodes = [NodeState(hostname=f"node-{i}", address=f"10.0.0.{i + 2}", ssh_port=22) for i in range(2)]
    state.save()
    done = dtrain_local("preempt", "node-1", "--notice", "1", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    [event] = json.loads((tmp_path / "metadata" / "events.json").read_text())["Events"]
    assert (event["EventId"], event["Resources"]) == (done.stdout.strip(), ["node-1"])

    unknown = dtrain_local("--state-dir", str(tmp_path), "preempt", "node-9")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.strip().splitlines() == [
        f"error: no node 'node-9' to evict in the local cluster in {tmp_path}: its nodes are node-0, node-1"
    ]
    for wrong in (tmp_path / "nothing-here", tmp_path / "metadata" / "events.json"):
        refused = dtrain_local("preempt", "node-0", "--state-dir", str(wrong))
        assert refused.returncode == 2, refused.stderr
        [line] = refused.stderr.strip().splitlines()
        assert line.startswith("error: ") and str(wrong) in line and "unexpected" not in line
    assert len(json.loads((tmp_path / "metadata" / "events.json").read_text())["Events"]) == 1


def test_a_preempt_that_no_platform_removed_expires(tmp_path, monkeypatch):
    """An event whose node's endpoint was gone (no platform to evict it) does not stay for ever."""
    local_metadata.announce_preempt(tmp_path, "node-0", notice_s=1)
    with local_metadata.events_document(tmp_path) as document:
        assert len(document["Events"]) == 1
    monkeypatch.setattr(local_metadata, "EVENT_EXPIRY_S", -5)  # as if the expiry had passed
    with local_metadata.events_document(tmp_path) as document:
        assert document["Events"] == []
    monkeypatch.undo()
    assert json.loads((tmp_path / "metadata" / "events.json").read_text())["Events"] == []


def test_each_attempt_is_priced_by_the_partition_it_ran_in(tmp_path):
    prices = {"gpu": 98.32, "spot": 18.0}
    job = {"run_id": "r", "price_per_node_hour_usd": 98.32, "prices_per_node_hour_usd": prices}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "evictions.json").write_text(json.dumps([{"event_id": "E", "node": "hvd-spot-000001"}]))
    now = int(time.time())
    for attempt, partition, code in ((1, "spot", 75), (2, "gpu", 0)):
        args = ["--nodes", "2", "--attempt", str(attempt), "--started-at", str(now - 1800), "--exit-code", str(code)]
        assert record_run(tmp_path, *args, "--partition", partition).returncode == 0
    record = json.loads((tmp_path / "run.json").read_text())
    first, second = record["attempts"]
    assert (first["partition"], first["preempted"], first["price_per_node_hour_usd"]) == ("spot", True, 18.0)
    assert (second["partition"], second["preempted"], second["price_per_node_hour_usd"]) == ("gpu", False, 98.32)
    assert first["estimated_cost_usd"] == pytest.approx(18.0, abs=0.2)  # 2 nodes x 30 minutes
    assert record["estimated_cost_usd"] == pytest.approx(18.0 + 98.32, abs=1.0)
    assert record["evictions"] == [{"event_id": "E", "node": "hvd-spot-000001"}]


ACCESS = SlurmAccess(
    cluster_name="hvd", partition="gpu", spot_partition="spot", controller_host="head",
    controller_address="10.0.0.2", login=SSHEndpoint(host="10.0.0.2", user="u"),
)  # fmt: skip


def test_spot_flags_pick_the_partitions() -> None:
    assert choose_partition(ACCESS, LaunchRequest("pytorch")) == "gpu"
    assert choose_partition(ACCESS, LaunchRequest("pytorch", spot=True)) == "spot"
    assert choose_partition(ACCESS, LaunchRequest("pytorch", spot_fallback=True)) == "spot,gpu"
    assert LaunchRequest("pytorch", spot=True).requeued  # an eviction requeues it
    no_spot = ACCESS.model_copy(update={"spot_partition": None})
    with pytest.raises(OperatorError, match=r"--spot: the cluster has no Spot partition \(set spotNodeCount"):
        choose_partition(no_spot, LaunchRequest("pytorch", spot=True))


SLURM_NODE = "hvd-gpu-00000a"  # Slurm's name for a scale set's 11th instance; Azure's host name is upper case
FAKE_SLURM = {
    # Slurm knows the node by its lower-case name only (node lookup is case-sensitive)
    "squeue": """for arg; do case $arg in --nodelist=*) node=${arg#--nodelist=} ;; esac; done
[ "$node" = "$SLURM_NODE" ] || { echo "squeue: error: Invalid node name specified" >&2; exit 1; }
kill -0 "$(cat "$RANK_PID")" 2>/dev/null && echo "$JOB_ID"
exit 0""",
    "scontrol": """echo "scontrol $*" >>"$SLURM_CALLS"
case "$*" in
  "show job -o $JOB_ID") state=RUNNING; kill -0 "$(cat "$RANK_PID")" 2>/dev/null || state=FAILED
    echo "JobId=$JOB_ID JobState=$state ExitCode=75:0 WorkDir=/nonexistent" ;;
  *"NodeName=$SLURM_NODE "*) ;;
  *NodeName=*) echo "scontrol: error: Invalid node name specified" >&2; exit 1 ;;
esac""",
}
# the job's rank: saves a "checkpoint" on SIGUSR1 and exits PREEMPTED, as training/world/preemption.py does
RANK = """import signal, sys, time
def preempted(*_):
    open(sys.argv[1], "w").write("checkpoint")
    sys.exit(75)
signal.signal(signal.SIGUSR1, preempted)
time.sleep(60)
"""


def test_an_upper_case_host_name_is_evicted_with_a_checkpoint_under_its_slurm_name(tmp_path, endpoint):
    """spot-agent.service passes %H, which Azure writes with upper-case base-36 digits (...00000A): the agent
    drains, checkpoints, requeues and powers down the node under Slurm's (lower-case) name all the same."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    job_id = str(900_000_000 + os.getpid())  # no other process on this machine has it
    checkpoint, calls, rank_pid = tmp_path / "checkpoint", tmp_path / "slurm-calls", tmp_path / "rank.pid"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_NODE": SLURM_NODE, "JOB_ID": job_id,
        "SLURM_CALLS": str(calls), "RANK_PID": str(rank_pid),
    }  # fmt: skip
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(checkpoint)], env={**env, "SLURM_JOB_ID": job_id})
    rank_pid.write_text(str(rank.pid))
    unit = (REMOTE_BOOT / "spot-agent.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.MULTILINE)[1]  # the unit's command, %H as Azure fills it
    argv = [*shlex.split(exec_start.replace("%H", SLURM_NODE.upper()))][1:]
    argv[0] = str(REMOTE_BOOT / "spot_agent.py")
    agent = subprocess.Popen([sys.executable, *argv, "--endpoint", endpoint, "--interval", "0.2"], env=env)
    try:
        local_metadata.announce_preempt(tmp_path, "node-0")
        assert rank.wait(timeout=20) == 75 and checkpoint.read_text() == "checkpoint"
        wait_for(lambda: "POWER_DOWN_ASAP" in (calls.read_text() if calls.exists() else ""), 20, "the power-down")
    finally:
        agent.terminate()
        agent.wait(timeout=10)
        rank.kill()
        rank.wait()
    said = calls.read_text()
    assert f"update NodeName={SLURM_NODE} State=DRAIN" in said and f"requeue {job_id}" in said
    assert f"update NodeName={SLURM_NODE} State=POWER_DOWN_ASAP" in said and SLURM_NODE.upper() not in said
