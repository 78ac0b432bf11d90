"""The Azure cluster's own custom data, booted for real (`make test-boot`, part of CI): the head node
and two GPU nodes as system containers (tests/boot/containers.py) under real systemd and cloud-init,
against Azure's endpoints and package repositories served on a hub namespace (tests/boot/cluster.py).

The story, in order (pytest runs a file's tests in order; each waits for events, not for seconds):
the first boot with two faults (node 0's Key Vault refuses for longer than the munge key's retries,
node 1's Slurm repository is down), both nodes rebooted once the fault is gone, and both join, node 1
drained at first, as Azure's node health checks (a stand-in in the image) failed one check at that
boot, then deallocated, resumed and started again by a job, its checks passing; a 2-node job of the
admin user, recorded by slurmdbd (sacct); telemetry and tracking answer; autostop
deallocates the idle nodes and a job starts one again; and across all of it no failed unit, no ordering
cycle, cloud-init `done`.
Runs as root, only when DTRAIN_BOOT_TEST=1 (the Makefile target sets it).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.boot.cluster import NODE_ADDRESSES, BootCluster, assert_nothing_left, boot_cluster
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
UPLOAD_RESULTS = Path(__file__).resolve().parents[2] / "dtrain" / "remote" / "job" / "upload_results.py"
REBOOT_DROP_IN = "/etc/systemd/system/node-setup.service.d/boot-test-munge-retry.conf"
# What the image's stand-in for Azure's checks fails while this file is there (the check and its figure,
# as NHC words them): tools/boot_image/rootfs/opt/azurehpc/test/azurehpc-health-checks/run-health-checks.sh
AZURE_FAULT = "/etc/boot-test/azure-checks.fail"
AZURE_FAILURE = "check_ib_bw_gdr: IB=mlx5_ib3, IB BW (expected > 380 Gbps, but measured 191 Gbps). FaultCode: NHC2003"


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
    assert_nothing_left(work, hub)
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
    # The first boot's registry login holds for about 3 hours: its timer must run from this boot on.
    registry = lambda: cluster.boot_report(node).get("registry-login") == "ok"  # noqa: E731
    cluster.wait_for(f"{node}'s registry login at first boot", registry, STEP_S)
    state = cluster.ssh(node, "systemctl is-active acr-login.timer", check=False).stdout.strip()
    assert state == "active", f"{node} at its first boot: acr-login.timer is {state}"
    cluster.azure.allow(NODE_ADDRESSES[KEY_VAULT_NODE])
    _reboot(cluster, node)
    cluster.wait_for(f"{node} registered after its reboot", lambda: cluster.registered(node), STEP_S)


def test_a_node_whose_first_package_install_failed_installs_at_its_next_boot(cluster: BootCluster) -> None:
    node = cluster.rendered.node_names[REPOSITORY_NODE]
    cluster.wait_for(f"{node}'s package step failing", lambda: _step_failed(cluster, node, "packages"), BOOT_S)
    assert cluster.azure.repository_refusals.get(NODE_ADDRESSES[REPOSITORY_NODE], 0) > 0
    cluster.azure.bring_repository_up(NODE_ADDRESSES[REPOSITORY_NODE])
    # At this next boot Azure's checks fail one check (the next test).
    cluster.hosts[node].write(AZURE_FAULT, AZURE_FAILURE)  # type: ignore[attr-defined]
    _reboot(cluster, node)
    cluster.wait_for(f"{node} registered after its reboot", lambda: cluster.registered(node), STEP_S)


def test_a_node_whose_azure_checks_fail_joins_drained_and_is_tried_afresh_once_powered_down(
    cluster: BootCluster,
) -> None:
    """Node 1's boot above ran Azure's checks before slurmd, and one failed: the node registered drained,
    its health report and boot report naming the check and its figure. Idle, autostop deallocates it and
    Slurm lifts the drain (idle_on_node_suspend: tried afresh); the next job that needs it starts it, as
    Azure would on other hardware, its checks pass at that boot, and it runs the job."""
    node = cluster.rendered.node_names[REPOSITORY_NODE]
    host = cluster.hosts[node]
    # (its reason in Slurm comes with the next health check: Slurm keeps the drain of a node that registers
    # while it holds it powered down, not the reason; the health report has it at once)
    cluster.wait_for(f"{node} drained as it registered", lambda: "DRAIN" in _states(cluster, node), STEP_S)
    failed = f"azurehpc-health-checks: {AZURE_FAILURE}"
    report = cluster.health_report(node)
    assert (report["azure_checks"], report["reason"]) == (failed, f"health-check: {failed}"), report
    assert cluster.boot_report(node)["azure-checks"] == f"failed: azure-health-checks: {AZURE_FAILURE}"
    # the size's configuration, as the node ran it: its NCCL all-reduce check without a topology file
    log = host.read("/var/log/azurehpc-health-checks.log")  # type: ignore[attr-defined]
    assert "/run/azure-health-checks/nd96isr_h100_v5.conf" in log and "check_nccl_allreduce 460.0 1 16G\n" in log, log

    lifted = lambda: _held_powered_down(cluster, node, drained=False)  # noqa: E731
    cluster.wait_for(f"{node} deallocated by autostop, its drain lifted (idle_on_node_suspend)", lifted, STEP_S)
    host.write(AZURE_FAULT, None)  # type: ignore[attr-defined]
    rc, output = cluster.sbatch(f"-N1 -w {node}", "hostname", timeout=STEP_S)
    assert rc == 0, output
    report = cluster.health_report(node)
    assert (report["azure_checks"], report["infiniband"], report["reason"]) == ("ok", "ok", ""), report


def _states(cluster: BootCluster, node: str) -> set[str]:
    return set(cluster.nodes().get(node, {}).get("State", "").split("+"))


def test_every_boot_step_succeeded_on_every_host(cluster: BootCluster) -> None:
    for host in ("head", *cluster.rendered.node_names):
        cluster.wait_for(f"{host}'s boot steps", lambda host=host: cluster.boot_report(host).get("ok") == "1", STEP_S)


def test_a_two_node_job_of_the_admin_user_runs_on_both_nodes_gpus_with_docker(cluster: BootCluster) -> None:
    # Either node may have been powered down by autostop since it registered: the job starts it again.
    task = "hostname; id -un; docker info >/dev/null && echo docker-ok"
    rc, output = cluster.sbatch("-N2 --gpus-per-node=8", f'srun sh -c "{task}"', timeout=STEP_S)
    assert rc == 0, output
    assert output.count(cluster.rendered.admin_user) == 2, output
    assert output.count("docker-ok") == 2, f"the admin user's jobs cannot use docker on every node: {output}"
    for name in cluster.rendered.node_names:
        assert name in output.lower(), output


def test_the_admin_users_jobs_are_in_the_accounting_database_with_their_gpus(cluster: BootCluster) -> None:
    """slurmdbd beside slurmctld, with MariaDB on the head's database disk: the 2-node job above is in sacct,
    charged to the cluster's default account, with its 16 GPUs (AccountingStorageTRES=gres/gpu)."""
    admin = cluster.rendered.admin_user

    def recorded() -> bool:
        listing = cluster.ssh(
            "head", "sacct -X -n -P -a -S now-2hours --format=User,Account,State,AllocTRES", check=False
        ).stdout
        return any(
            line.startswith(f"{admin}|dtrain|COMPLETED|") and "gres/gpu=16" in line.split("|")[3].split(",")
            for line in listing.splitlines()
        )

    cluster.wait_for("the 2-node job in sacct", recorded, STEP_S)
    assert cluster.ssh("head", "findmnt -n -o TARGET /var/lib/mysql").stdout.strip() == "/var/lib/mysql"


def test_a_jobs_results_reach_the_results_container_with_the_nodes_identity(cluster: BootCluster) -> None:
    """The job tools' upload (upload_results.py, as job.sh runs it on the first node): a token for
    Azure Storage from IMDS with the nodes' identity, HTTPS to the account's name."""
    assert cluster.shared is not None
    tools = cluster.shared / "tools"
    tools.mkdir(exist_ok=True)
    shutil.copy(UPLOAD_RESULTS, tools / UPLOAD_RESULTS.name)
    rendered, run = cluster.rendered, f"boot-test-{time.monotonic_ns()}"
    upload = (f"python3 /shared/tools/{UPLOAD_RESULTS.name} --dir /shared/runs/{run} --container "
              f"{rendered.results_container} --account-url https://{rendered.results_account}.blob.core.windows.net "
              f"--prefix {run} --managed-identity --client-id {rendered.cluster_client_id}")  # fmt: skip
    job = f'mkdir -p /shared/runs/{run} && srun sh -c "hostname >>/shared/runs/{run}/hosts" && {upload}'
    rc, output = cluster.sbatch("-N2", job, timeout=STEP_S)
    assert rc == 0, output
    with cluster.hub.entered():
        container = cluster.results.client().get_container_client(rendered.results_container)
        hosts = container.download_blob(f"{run}/hosts").readall().decode().split()
    assert sorted(name.lower() for name in hosts) == rendered.node_names, hosts


def test_every_host_runs_clean_while_a_job_holds_the_nodes(cluster: BootCluster) -> None:
    """Both nodes kept up by a job (autostop would take them): the registry login's timer, telemetry
    and tracking answer, and no host has a failed unit, an ordering cycle or a cloud-init error."""
    job = cluster.ssh("head", "sbatch --parsable -N2 -o /dev/null --wrap 'sleep 1200'").stdout.strip()
    try:
        cluster.wait_for("the holding job running", lambda: _job_state(cluster, job) == "RUNNING", STEP_S)
        for name in cluster.rendered.node_names:
            state = cluster.ssh(name, "systemctl is-active acr-login.timer", check=False).stdout.strip()
            assert state == "active", f"{name}: acr-login.timer is {state}"
        _check_telemetry_and_tracking(cluster)
        for host in ("head", *cluster.rendered.node_names):
            _check_clean(cluster, host)
    finally:
        cluster.ssh("head", f"scancel {job}", check=False)


def _job_state(cluster: BootCluster, job: str) -> str:
    return cluster.ssh("head", f"squeue -h -j {job} -o %T", check=False).stdout.strip()


def _answers(cluster: BootCluster, url: str) -> bool:
    return cluster.hub.run(["curl", "-fsS", "-o", "/dev/null", "--max-time", "5", url], check=False).returncode == 0


def _check_telemetry_and_tracking(cluster: BootCluster) -> None:
    head = cluster.addresses["head"]
    cluster.wait_for("Prometheus on the head", lambda: _answers(cluster, f"http://{head}:9090/-/ready"), STEP_S)
    for name in cluster.rendered.node_names:
        url = f"http://{cluster.addresses[name]}:9100/metrics"
        cluster.wait_for(f"node_exporter on {name}", lambda url=url: _answers(cluster, url), STEP_S)
    cluster.wait_for("MLflow on the head", lambda: _answers(cluster, f"http://{head}:5000/health"), BOOT_S)


def _check_clean(cluster: BootCluster, host: str) -> None:
    failed = cluster.ssh(host, "systemctl --failed --plain --no-legend | cut -d' ' -f1", check=False).stdout.split()
    assert not set(failed) - set(UNITS_FAILING_IN_ANY_CONTAINER), f"{host}: failed units {failed}"
    cycles = cluster.ssh(host, "sudo journalctl --no-pager -q | grep -i 'ordering cycle'", check=False).stdout
    assert not cycles, f"{host}: {cycles}"
    status = cluster.ssh(host, "cloud-init status --long", check=False).stdout
    assert "status: done" in status, f"{host}: {status}"


def test_autostop_deallocates_idle_nodes_and_a_job_starts_one_again(cluster: BootCluster) -> None:
    nodes = [cluster.hosts[name] for name in cluster.rendered.node_names]
    cluster.wait_for("idle nodes deallocated", lambda: not any(node.running() for node in nodes), STEP_S)
    assert any(call.startswith("deallocate") for call in cluster.azure.calls), cluster.azure.calls
    # On the resumed node, the registry login of this boot ended before slurmd started (monotonic us).
    order = (
        "systemctl show -p ExecMainExitTimestampMonotonic --value acr-login-boot.service; "
        "systemctl show -p ExecMainStartTimestampMonotonic --value slurmd.service"
    )
    rc, output = cluster.sbatch("-N1", f"hostname; {order}", timeout=STEP_S)
    assert rc == 0, output
    assert any(call.startswith("start") for call in cluster.azure.calls), cluster.azure.calls
    (resumed,) = [name for name in cluster.rendered.node_names if cluster.hosts[name].running()]
    login_done, slurmd_started = (int(value) for value in output.split()[-2:])
    assert 0 < login_done <= slurmd_started, f"{resumed}: the registry login of this boot did not precede slurmd"
    state = cluster.ssh(resumed, "systemctl is-active acr-login.timer", check=False).stdout.strip()
    assert state == "active", f"{resumed} after its resume: acr-login.timer is {state}"
    _check_clean(cluster, resumed)


def test_a_node_that_never_registers_is_deallocated_by_the_reaper(cluster: BootCluster) -> None:
    """A node Azure runs outside Slurm (a first boot) whose slurmd never comes up bills until the reaper,
    which needs it to have run for register_timeout_s (an hour; 0 here) while Slurm holds it down."""
    name = cluster.rendered.node_names[0]
    node = cluster.hosts[name]
    cluster.wait_for(
        "idle nodes deallocated",
        lambda: not any(cluster.hosts[n].running() for n in cluster.rendered.node_names),
        STEP_S,
    )
    # Slurm counts a node as its own to power while it is powering down (SuspendTimeout): wait it out.
    cluster.wait_for(f"Slurm holding {name} powered down", lambda: _held_powered_down(cluster, name), STEP_S)
    node.mask("slurmd.service")
    try:
        cluster.power("start", ["0"])  # as a pulumi up creates it: no Slurm resume
        cluster.wait_for(f"{name} booted", lambda: cluster.ssh(name, "true", check=False).returncode == 0, BOOT_S)
        with cluster.power_settings(register_timeout_s=0):
            cluster.reap()
            cluster.wait_for(f"{name} deallocated by the reaper", lambda: not node.running(), STEP_S)
    finally:
        node.unmask("slurmd.service")
    log = cluster.ssh("head", "sudo tail -n 30 /var/log/slurm/power.log").stdout
    assert f"{name} not registered" in log, log


def _held_powered_down(cluster: BootCluster, node: str, *, drained: bool | None = None) -> bool:
    """Slurm holds node powered down, and is not changing its power; drained: and it is (not) drained too."""
    states = _states(cluster, node)
    held = "POWERED_DOWN" in states and not states & {"POWERING_DOWN", "POWERING_UP", "POWER_DOWN"}
    return held and (drained is None or drained == ("DRAIN" in states))


def test_the_reaper_deallocates_every_node_while_slurmctld_is_broken(cluster: BootCluster) -> None:
    """Slurm broken on the head (here: slurm.conf with a key slurmctld refuses) after the nodes came up:
    nothing vouches for them, and once the grace has passed (an hour; 0 here) every instance goes."""
    cluster.ssh(
        "head",
        "echo NotASlurmKey=1 | sudo tee -a /etc/slurm/slurm.conf >/dev/null; sudo systemctl restart slurmctld",
        check=False,
    )
    assert cluster.ssh("head", "scontrol ping", check=False).returncode != 0
    cluster.power("start", ["0", "1"])  # a first pulumi up, or a resume Slurm can no longer follow
    names = cluster.rendered.node_names
    cluster.wait_for(
        "both nodes booted", lambda: all(cluster.ssh(n, "true", check=False).returncode == 0 for n in names), BOOT_S
    )
    with cluster.power_settings(controller_grace_s=0):
        cluster.reap()
        cluster.reap()  # the first silent round starts the grace, the next one acts on it
        cluster.wait_for("every node deallocated", lambda: not any(cluster.hosts[n].running() for n in names), STEP_S)
    log = cluster.ssh("head", "sudo tail -n 30 /var/log/slurm/power.log").stdout
    assert "slurmctld has not answered" in log, log
