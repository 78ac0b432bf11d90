"""The shared file system released before a node goes (sharedStorage lustre): the release program against
a real mount (a tmpfs in a mount namespace of its own), the head node's power program asking through
Slurm's comment before it deallocates (against the fake Azure and a stand-in scontrol), and the node
agent answering. The whole order on a cluster, suspend and Spot eviction: tests/scripts/test_shared_release.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.remote.boot import spot_agent
from dtrain.remote.slurm import slurm_power
from infra.cloud_init.head_node import POWER_CONFIG_PATH, RELEASE_WAIT_S
from tests.infra.documents import LUSTRE_SHARE, head_doc, script_of
from tests.infra.sandbox import Sandbox
from tests.infra.test_slurm import SCALE_SET_ID, FakeAzure, run_power, serving_fake_azure, shown, started

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "dtrain" / "remote" / "boot" / "shared_release.py"
NODES = ["hvd-gpu-000000", "hvd-gpu-000001"]


@pytest.fixture
def azure() -> Iterator[FakeAzure]:
    with serving_fake_azure() as fake:
        yield fake


def test_the_agent_and_the_power_program_speak_the_same_comments() -> None:
    """Both stand alone on their hosts: their copies of the protocol must agree."""
    for name in ("RELEASE_REQUEST", "RELEASED", "RELEASE_FAILED"):
        assert getattr(spot_agent, name) == getattr(slurm_power, name), name


def test_the_head_node_waits_for_the_release_only_on_a_lustre_stack() -> None:
    assert json.loads(script_of(head_doc(shared=LUSTRE_SHARE), POWER_CONFIG_PATH))["release_wait_s"] == RELEASE_WAIT_S
    assert "release_wait_s" not in json.loads(script_of(head_doc(), POWER_CONFIG_PATH))


# --- the release program, on a real mount -----------------------------------------------------------


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A tmpfs at tmp_path/shared in a mount namespace of its own: (the mount, the argv prefix that runs a
    command in that namespace). Needs root, as the local cluster does."""
    mount = tmp_path / "shared"
    mount.mkdir()
    holder = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount -t tmpfs tmpfs "{mount}" && exec sleep 600',
        ],
    )
    enter = ["nsenter", f"--target={holder.pid}", "--mount"]
    deadline = time.monotonic() + 30
    while subprocess.run([*enter, "mountpoint", "-q", str(mount)]).returncode != 0:
        assert holder.poll() is None and time.monotonic() < deadline, "the stand-in mount did not come up"
        time.sleep(0.05)
    try:
        yield mount, enter
    finally:
        holder.kill()
        holder.wait()


def start_in(enter: list[str], script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*enter, "sh", "-c", script])


def run_release(enter: list[str], mount: Path, *extra: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [*enter, sys.executable, str(RELEASE), "--mount", str(mount), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def wait_until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)


def test_release_stops_every_writer_flushes_and_unmounts(mounted: tuple[Path, list[str]]) -> None:
    """A writer with a file open, one that ignores SIGTERM, and one whose working directory is a bind mount
    of a subdirectory in a namespace of its own (as a container's run directory is): all found through
    /proc, the stubborn one killed after the grace, then the mount flushed and gone."""
    mount, enter = mounted
    workdir = mount.parent / "workdir"  # where the container-like writer sees the run directory
    workdir.mkdir()
    subprocess.run([*enter, "mkdir", str(mount / "runs")], check=True)
    writers = [
        start_in(enter, f'exec 3>>"{mount}/log"; while :; do echo x >&3; sleep 0.05; done'),
        start_in(enter, f"trap '' TERM; exec 3>>\"{mount}/ckpt\"; while :; do sleep 0.05; done"),
        start_in(
            enter,
            f'exec unshare --mount --propagation private sh -c \'mount --bind "{mount}/runs" "{workdir}" && '
            f'cd "{workdir}" && exec sleep 600\'',
        ),
    ]

    def in_place() -> bool:
        files = subprocess.run([*enter, "ls", str(mount)], capture_output=True, text=True).stdout.split()
        try:
            cwd = os.readlink(f"/proc/{writers[2].pid}/cwd")
        except OSError:
            return False
        return {"log", "ckpt"} <= set(files) and cwd == str(workdir)

    wait_until(in_place, "the writers have their files open and their directory entered")
    before = time.time()
    code, summary = run_release(enter, mount, "--grace", "1", "--timeout", "30")
    assert code == 0, summary
    assert summary["unmounted"] and summary["flushed"] and "error" not in summary
    assert len(summary["writers"]) >= 3 and summary["killed"]  # the one that ignored SIGTERM
    at = summary["at"]
    assert before <= at["writers_stopped"] <= at["flushed"] <= at["unmounted"]
    for writer in writers:
        assert writer.wait(timeout=10) is not None
    assert subprocess.run([*enter, "mountpoint", "-q", str(mount)]).returncode != 0
    # again: nothing is mounted there, which is a release done
    code, summary = run_release(enter, mount)
    assert code == 0 and summary["error"] == f"nothing mounted at {mount}"


def test_release_refuses_a_relative_mount() -> None:
    proc = subprocess.run([sys.executable, str(RELEASE), "--mount", "shared"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--mount must be an absolute path" in proc.stderr


# --- the power program asks, and deallocates after the answers ---------------------------------------


def stub_scontrol_answers(sandbox: Sandbox, *answers: str) -> None:
    """scontrol: `show node NAMES` prints answers[0], then answers[1], ... (the last one from then on);
    updates are only logged."""
    for index, text in enumerate(answers):
        (sandbox.state / f"show-{index}").write_text(text)
    sandbox.stub(
        "scontrol",
        'case "$*" in\n'
        '  "show hostnames "*) tr "," "\\n" <<<"$3" ;;\n'
        '  "--oneliner show node"*)\n'
        '    n=$(cat "$STUB_STATE/n" 2>/dev/null || echo 0); echo $((n + 1)) >"$STUB_STATE/n"\n'
        f'    [ "$n" -lt {len(answers)} ] || n={len(answers) - 1}; cat "$STUB_STATE/show-$n" ;;\n'
        "esac",
    )


def both(first_comment: str, second_comment: str, state: str = "IDLE+CLOUD+POWERING_DOWN") -> str:
    return shown(NODES[0], state, first_comment) + shown(NODES[1], state, second_comment)


def test_suspend_deallocates_only_after_every_node_answered(sandbox: Sandbox, azure: FakeAzure) -> None:
    azure.stub_log = sandbox.log
    stub_scontrol_answers(
        sandbox,
        both("", "started-by-slurm"),  # before the request
        both(slurm_power.RELEASE_REQUEST, slurm_power.RELEASE_REQUEST),  # the agents have not answered yet
        both(slurm_power.RELEASED, slurm_power.RELEASE_FAILED),
    )
    result = run_power(sandbox, azure, "suspend", ",".join(NODES), config={"release_wait_s": 60})
    assert result.returncode == 0, result.stderr
    (deallocate,) = [call for call in azure.arm_calls() if call.path == f"{SCALE_SET_ID}/deallocate"]
    assert deallocate.body == {"instanceIds": ["0", "1"]}
    updates = [call for call in sandbox.calls("scontrol") if "update" in call]
    assert updates == [
        f"scontrol update nodename={','.join(NODES)} comment={slurm_power.RELEASE_REQUEST}",
        f"scontrol update nodename={','.join(NODES)} comment=",
    ]
    # the deallocation came after the request and after the last read, which had both answers
    asked_before = [call for call in deallocate.seen if call.startswith("scontrol")]
    assert asked_before[-1].startswith("scontrol --oneliner show node") and updates[0] in asked_before
    assert len([call for call in asked_before if "show node" in call]) == 3
    log = (sandbox.root / "power.log").read_text()
    assert f"{NODES[0]}: shared file system {slurm_power.RELEASED}" in log
    assert f"WARNING {NODES[1]}: shared file system {slurm_power.RELEASE_FAILED}" in log


def test_a_node_that_never_answers_is_deallocated_once_the_wait_is_spent(sandbox: Sandbox, azure: FakeAzure) -> None:
    azure.stub_log = sandbox.log
    stub_scontrol_answers(sandbox, both(slurm_power.RELEASE_REQUEST, slurm_power.RELEASE_REQUEST))
    started = time.monotonic()
    result = run_power(sandbox, azure, "suspend", NODES[0], config={"release_wait_s": 1})
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 1 + slurm_power.RELEASE_POLL_S + 30  # the wait, a poll, a loaded machine
    assert [call.body for call in azure.arm_calls()] == [{"instanceIds": ["0"]}]
    assert f"{NODES[0]}: shared file system no answer within 1 s" in (sandbox.root / "power.log").read_text()


def test_a_node_its_agent_released_for_an_eviction_is_not_asked_again(sandbox: Sandbox, azure: FakeAzure) -> None:
    stub_scontrol_answers(sandbox, shown(NODES[0], "IDLE+DRAIN+CLOUD+POWERING_DOWN", slurm_power.RELEASED))
    result = run_power(sandbox, azure, "suspend", NODES[0], config={"release_wait_s": 60})
    assert result.returncode == 0, result.stderr
    assert [call for call in sandbox.calls("scontrol") if "update" in call] == [
        f"scontrol update nodename={NODES[0]} comment="
    ]
    assert "released before it was asked" in (sandbox.root / "power.log").read_text()


def test_a_comment_that_slurm_lists_after_the_reason_is_read(sandbox: Sandbox, azure: FakeAzure) -> None:
    """Slurm 22.05 lists Comment= after the free-text Reason=: an evicted node's answer sits there."""
    line = f"NodeName={NODES[0]} State=IDLE+CLOUD+DRAIN+POWERING_DOWN Reason=spot eviction [root@2026-12-07T06:37:39]"
    stub_scontrol_answers(sandbox, f"{line} Comment={slurm_power.RELEASED}\n")
    assert run_power(sandbox, azure, "suspend", NODES[0], config={"release_wait_s": 60}).returncode == 0
    assert "released before it was asked" in (sandbox.root / "power.log").read_text()


def test_on_nfs_suspend_asks_nothing(sandbox: Sandbox, azure: FakeAzure) -> None:
    stub_scontrol_answers(sandbox, both("", ""))
    assert run_power(sandbox, azure, "suspend", ",".join(NODES)).returncode == 0
    assert not [call for call in sandbox.calls("scontrol") if "show node" in call or "release" in call]


def test_the_reaper_asks_the_unregistered_nodes_before_it_deallocates_them(sandbox: Sandbox, azure: FakeAzure) -> None:
    """A node Azure runs and Slurm holds as powered down, past the registration bound: marked DOWN, asked to
    release the file system (it may have mounted it at boot), then deallocated, and its comment cleared."""
    azure.stub_log = sandbox.log
    held = shown(NODES[0], "IDLE+CLOUD+POWERED_DOWN")
    stub_scontrol_answers(
        sandbox,
        held,  # the reaper's listing
        held,  # still held off after the instance view
        shown(NODES[0], "DOWN+CLOUD+POWERED_DOWN", slurm_power.RELEASE_REQUEST),
        shown(NODES[0], "DOWN+CLOUD+POWERED_DOWN", slurm_power.RELEASED),
    )
    sandbox.stub("squeue")
    azure.answers["GET /virtualMachines/0/instanceView"] = [(200, started(120))]
    result = run_power(sandbox, azure, "reap", config={"release_wait_s": 60, "register_timeout_s": 3600})
    assert result.returncode == 0, result.stderr + (sandbox.root / "power.log").read_text()
    (deallocate,) = [call for call in azure.arm_calls() if call.path.endswith("/deallocate")]
    updates = [call for call in sandbox.calls("scontrol") if "update" in call]
    assert [update.split(" ", 3)[3].split("=", 1)[0] for update in updates] == ["state", "comment", "comment"]
    assert updates[1].endswith(f"comment={slurm_power.RELEASE_REQUEST}") and updates[2].endswith("comment=")
    assert updates[1] in deallocate.seen and updates[2] not in deallocate.seen


# --- the node's agent answers ------------------------------------------------------------------------


def agent_answers(sandbox: Sandbox, state: str, comment: str, release_exit: int) -> list[str]:
    """The agent's answer_release_request against a stand-in scontrol and release program: the calls made."""
    listing = f"NodeName=$4 State={state} Comment={comment} Reason=none"
    sandbox.stub("scontrol", f'case "$*" in\n  "--oneliner show node"*) echo "{listing}" ;;\nesac')
    summary = {"unmounted": release_exit == 0, "error": "" if release_exit == 0 else "/shared is still mounted"}
    sandbox.stub("shared-release", f"echo '{json.dumps(summary)}'; exit {release_exit}")
    driver = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('agent', {str(REPO / 'dtrain/remote/boot/spot_agent.py')!r})\n"
        "agent = importlib.util.module_from_spec(spec); spec.loader.exec_module(agent)\n"
        f"agent.answer_release_request('hvd-gpu-000001', ({str(sandbox.bin / 'shared-release')!r}, '/shared'))\n"
    )
    result = sandbox.run(driver, interpreter="python3")
    assert result.returncode == 0, result.stderr
    return [line for line in sandbox.log.read_text().splitlines() if not line.startswith("scontrol --oneliner")]


def test_the_agent_releases_when_asked_while_slurm_powers_the_node_down(sandbox: Sandbox) -> None:
    calls = agent_answers(sandbox, "IDLE+CLOUD+POWERING_DOWN", spot_agent.RELEASE_REQUEST, 0)
    assert calls[0].startswith("shared-release --mount /shared --grace 10 --timeout 60")
    assert calls[1:] == [f"scontrol update NodeName=hvd-gpu-000001 Comment={spot_agent.RELEASED}"]


def test_the_agent_says_why_a_release_failed(sandbox: Sandbox) -> None:
    calls = agent_answers(sandbox, "IDLE+CLOUD+POWERING_DOWN", spot_agent.RELEASE_REQUEST, 1)
    assert calls[1:] == [f"scontrol update NodeName=hvd-gpu-000001 Comment={spot_agent.RELEASE_FAILED}"]


@pytest.mark.parametrize(
    ("state", "comment"),
    [("IDLE+CLOUD", spot_agent.RELEASE_REQUEST), ("ALLOCATED+CLOUD", spot_agent.RELEASE_REQUEST),
     ("IDLE+CLOUD+POWERING_DOWN", "started-by-slurm")],
)  # fmt: skip
def test_a_stale_request_never_unmounts_a_node_at_work(sandbox: Sandbox, state: str, comment: str) -> None:
    assert agent_answers(sandbox, state, comment, 0) == []
