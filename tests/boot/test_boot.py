"""The Azure cluster's own custom data, booted for real (`make test-boot`, part of CI): the head node
and two GPU nodes as system containers (tests/boot/containers.py) under real systemd and cloud-init,
against Azure's endpoints and package repositories served on a hub namespace (tests/boot/cluster.py).

The story, in order (pytest runs a file's tests in order; each waits for events, not for seconds):
the first boot with two faults (node 0's Key Vault refuses for longer than the munge key's retries,
node 1's Slurm repository is down), both nodes rebooted once the fault is gone, and both join; a
2-node job of the admin user; telemetry and tracking answer; autostop deallocates the idle nodes and a
job starts one again; and across all of it no failed unit, no ordering cycle, cloud-init `done`.
Runs as root, only when DTRAIN_BOOT_TEST=1 (the Makefile target sets it).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.boot.cluster import NODE_ADDRESSES, BootCluster, boot_cluster
from tests.boot.containers import EXCLUSIONS, UNITS_FAILING_IN_ANY_CONTAINER

pytestmark = pytest.mark.skipif(
    os.environ.get("DTRAIN_BOOT_TEST") != "1" or os.geteuid() != 0,
    reason="the boot test runs with `make test-boot` (DTRAIN_BOOT_TEST=1), as root",
)
# Bounds on a loaded 2-core machine, each far above what an event takes unloaded (the note in
# ../shared/boot-in-containers.md: cloud-init done in about 75 s, a node registered in 95 s).
BOOT_S = 600
STEP_S = 420
# Node 0's munge key: its retries end after this (a drop-in of the test's), while Key Vault refuses
# until the test allows it, so the first boot's step fails and only a reboot can bring the node in.
MUNGE_RETRY_S = 20
KEY_VAULT_NODE, REPOSITORY_NODE = 0, 1
REBOOT_DROP_IN = "/etc/systemd/system/node-setup.service.d/boot-test-munge-retry.conf"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootCluster]:
    started = time.monotonic()
    work = tmp_path_factory.mktemp("boot")
    names = ("hvd-gpu-000000", "hvd-gpu-000001")
    drop_in = f"[Service]\nEnvironment=MUNGE_KEY_RETRY_FOR_SECONDS={MUNGE_RETRY_S}\n".encode()
    with boot_cluster(work, host_files={names[KEY_VAULT_NODE]: {REBOOT_DROP_IN: drop_in}}, faults=_faults) as booted:
        print("\nsubstitutions in the custom data:")
        for edit in booted.rendered.substitutions:
            print(f"  {edit}")
        print("what system containers cannot show (the VM harness, make test-boot-vm, covers it):")
        for exclusion in EXCLUSIONS:
            print(f"  {exclusion}")
        yield booted
        hub = booted.hub.name
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"
    assert not Path(f"/run/netns/{hub}").exists(), "the test's network namespace is left"
    print(f"\nboot test: {time.monotonic() - started:.0f} s")


def _faults(cluster: BootCluster) -> None:
    """Before the first boot: node 0's Key Vault refuses, node 1's Slurm repository is down."""
    cluster.azure.forbid(NODE_ADDRESSES[KEY_VAULT_NODE])
    cluster.azure.take_repository_down(NODE_ADDRESSES[REPOSITORY_NODE])


def _step_failed(cluster: BootCluster, node: str, *steps: str) -> bool:
    report = cluster.boot_report(node)
    return any(report.get(step, "").startswith("failed") for step in steps)


def _reboot(cluster: BootCluster, host: str) -> None:
    cluster.hosts[host].stop()
    cluster.hosts[host].start()


def test_a_step_that_failed_at_first_boot_runs_again_at_the_next_boot(cluster: BootCluster) -> None:
    node = cluster.rendered.node_names[KEY_VAULT_NODE]
    cluster.wait_for(
        f"{node}'s slurmd step failing on Key Vault", lambda: _step_failed(cluster, node, "slurmd"), BOOT_S
    )
    assert not cluster.ready(node)
    cluster.azure.allow(NODE_ADDRESSES[KEY_VAULT_NODE])
    _reboot(cluster, node)
    cluster.wait_for(f"{node} registered after its reboot", lambda: cluster.registered(node), STEP_S)


def test_a_node_whose_first_package_install_failed_installs_at_its_next_boot(cluster: BootCluster) -> None:
    node = cluster.rendered.node_names[REPOSITORY_NODE]
    cluster.wait_for(f"{node}'s package step failing", lambda: _step_failed(cluster, node, "packages"), BOOT_S)
    assert cluster.azure.repository_refusals.get(NODE_ADDRESSES[REPOSITORY_NODE], 0) > 0
    cluster.azure.bring_repository_up(NODE_ADDRESSES[REPOSITORY_NODE])
    _reboot(cluster, node)
    cluster.wait_for(f"{node} registered after its reboot", lambda: cluster.registered(node), STEP_S)


def test_every_boot_step_succeeded_on_every_host(cluster: BootCluster) -> None:
    for host in ("head", *cluster.rendered.node_names):
        cluster.wait_for(f"{host}'s boot steps", lambda host=host: cluster.boot_report(host).get("ok") == "1", STEP_S)


def test_a_two_node_job_of_the_admin_user_runs_on_both_nodes_gpus(cluster: BootCluster) -> None:
    # Either node may have been powered down by autostop since it registered: the job starts it again.
    rc, output = cluster.sbatch("-N2 --gpus-per-node=8", "srun hostname; id -un", timeout=STEP_S)
    assert rc == 0, output
    assert output.count(cluster.rendered.admin_user) == 1, output
    for name in cluster.rendered.node_names:
        assert name.upper()[-6:] in output.upper(), output


def test_the_registry_login_is_renewed_on_every_node(cluster: BootCluster) -> None:
    for name in cluster.rendered.node_names:
        state = cluster.ssh(name, "systemctl is-active acr-login.timer", check=False).stdout.strip()
        assert state == "active", f"{name}: acr-login.timer is {state}"


def test_telemetry_and_tracking_answer(cluster: BootCluster) -> None:
    head = cluster.addresses["head"]

    def answers(url: str) -> bool:
        return cluster.hub.run(["curl", "-fsS", "-o", "/dev/null", "--max-time", "5", url], check=False).returncode == 0

    cluster.wait_for("Prometheus on the head", lambda: answers(f"http://{head}:9090/-/ready"), STEP_S)
    for name in cluster.rendered.node_names:
        cluster.wait_for(
            f"node_exporter on {name}",
            lambda name=name: answers(f"http://{cluster.addresses[name]}:9100/metrics"),
            STEP_S,
        )
    cluster.wait_for("MLflow on the head", lambda: answers(f"http://{head}:5000/health"), BOOT_S)


def test_autostop_deallocates_idle_nodes_and_a_job_starts_one_again(cluster: BootCluster) -> None:
    nodes = [cluster.hosts[name] for name in cluster.rendered.node_names]
    cluster.wait_for("idle nodes deallocated", lambda: not any(node.running() for node in nodes), STEP_S)
    assert any(call.startswith("deallocate") for call in cluster.azure.calls), cluster.azure.calls
    rc, output = cluster.sbatch("-N1", "hostname", timeout=STEP_S)
    assert rc == 0, output
    assert any(call.startswith("start") for call in cluster.azure.calls), cluster.azure.calls
    (resumed,) = [name for name in cluster.rendered.node_names if cluster.hosts[name].running()]
    state = cluster.ssh(resumed, "systemctl is-active acr-login.timer", check=False).stdout.strip()
    assert state == "active", f"{resumed} after its resume: acr-login.timer is {state}"


def test_no_host_has_a_failed_unit_an_ordering_cycle_or_a_cloud_init_error(cluster: BootCluster) -> None:
    running = [name for name, host in cluster.hosts.items() if host.running()]
    assert "head" in running
    for host in running:
        failed = cluster.ssh(host, "systemctl --failed --plain --no-legend | cut -d' ' -f1", check=False).stdout.split()
        assert not set(failed) - set(UNITS_FAILING_IN_ANY_CONTAINER), f"{host}: failed units {failed}"
        cycles = cluster.ssh(host, "sudo journalctl --no-pager -q | grep -i 'ordering cycle'", check=False).stdout
        assert not cycles, f"{host}: {cycles}"
        status = cluster.ssh(host, "cloud-init status --long", check=False).stdout
        assert "status: done" in status, f"{host}: {status}"
