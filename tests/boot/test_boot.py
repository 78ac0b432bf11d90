"""The Azure cluster's own custom data, booted by cloud-init in QEMU/KVM VMs (`make test-boot`).

The NFS server, the head node and two GPU nodes boot what the Pulumi program renders (with the
substitutions the test prints), against Azure's endpoints served on the VMs' network. Runs as root
with /dev/kvm, only when DTRAIN_BOOT_TEST=1 (the Makefile target sets it): it takes minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.boot.cluster import BootCluster, boot_cluster

pytestmark = pytest.mark.skipif(
    os.environ.get("DTRAIN_BOOT_TEST") != "1" or os.geteuid() != 0,
    reason="the boot test runs with `make test-boot` (DTRAIN_BOOT_TEST=1), as root",
)
KEY_VAULT_FORBIDDEN_S = 60  # the second node's first minute: Key Vault answers 403, as before RBAC propagates
BOOT_S = 900  # every VM's first boot, in software emulation on 2 shared cores
REBOOT_S = 420


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootCluster]:
    started = time.monotonic()
    work = tmp_path_factory.mktemp("boot")
    with boot_cluster(work, forbid_vault_s={1: KEY_VAULT_FORBIDDEN_S}) as booted:
        print("\nsubstitutions in the custom data:")
        for edit in booted.rendered.substitutions:
            print(f"  {edit}")
        yield booted
        namespace = booted.namespace.name
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"
    assert not Path(f"/run/netns/{namespace}").exists(), "the test's network namespace is left"
    print(f"\nboot test: {time.monotonic() - started:.0f} s")


def _nodes(cluster: BootCluster) -> dict[str, dict[str, str]]:
    out = cluster.ssh("head", "scontrol show node -o", check=False).stdout
    nodes = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            nodes[fields["NodeName"]] = fields
    return nodes


def _ready(fields: dict[str, str] | None) -> bool:
    states = set((fields or {}).get("State", "").split("+"))
    return "IDLE" in states and not states & {
        "POWERED_DOWN",
        "POWERING_UP",
        "POWERING_DOWN",
        "DRAIN",
        "DOWN",
        "NOT_RESPONDING",
    }


def _sbatch(cluster: BootCluster, options: str, command: str, timeout: float) -> tuple[int, str]:
    """A job submitted on the head node as the admin user; its exit status and output."""
    out = f"/shared/runs/boot-test-{time.monotonic_ns()}.out"
    submitted = cluster.ssh(
        "head",
        f"sbatch --wait --parsable {options} -o {out} --wrap '{command}'; echo rc=$?; cat {out}",
        timeout=timeout,
        check=False,
    )
    match = re.search(r"^rc=(\d+)$", submitted.stdout, re.MULTILINE)
    assert match, f"sbatch: {submitted.stdout}{submitted.stderr}"
    return int(match[1]), submitted.stdout


def test_nfs_server_exports_its_raid_volume(cluster: BootCluster) -> None:
    def exported() -> bool:
        result = cluster.ssh("nfs", "sudo exportfs -v", check=False)
        return "/export" in result.stdout

    cluster.wait_for("the NFS server's export", exported, BOOT_S)
    volume = cluster.ssh("nfs", "findmnt -n -o SOURCE,FSTYPE /export").stdout.split()
    assert volume[0].startswith("/dev/md") and volume[1] == "xfs", volume
    assert "10.40.0.0/18" in cluster.ssh("nfs", "sudo exportfs -v").stdout


def test_head_runs_slurmctld_with_the_rendered_configuration(cluster: BootCluster) -> None:
    cluster.wait_for(
        "slurmctld on the head node",
        lambda: cluster.ssh("head", "scontrol ping", check=False).stdout.count("UP") >= 1,
        BOOT_S,
    )
    (rendered,) = [
        entry["content"]
        for entry in yaml.safe_load(cluster.rendered.documents["head"])["write_files"]
        if entry["path"] == "/etc/slurm/slurm.conf"
    ]
    assert cluster.ssh("head", "cat /etc/slurm/slurm.conf").stdout == rendered


def test_both_nodes_register_with_their_gpus_cpus_and_memory(cluster: BootCluster) -> None:
    names = cluster.rendered.node_names
    cluster.wait_for("both nodes registered", lambda: all(_ready(_nodes(cluster).get(name)) for name in names), BOOT_S)
    for name in names:
        fields = _nodes(cluster)[name]
        assert fields["Gres"] == "gpu:8", fields
        assert (fields["CPUTot"], fields["RealMemory"]) == ("1", "768"), fields


def test_a_node_whose_key_vault_refused_at_first_still_joined(cluster: BootCluster) -> None:
    assert cluster.azure.refusals.get("10.40.0.5", 0) >= 1, "Key Vault never refused the second node"
    assert _ready(_nodes(cluster).get(cluster.rendered.node_names[1]))


def test_a_two_node_job_runs_as_the_admin_user(cluster: BootCluster) -> None:
    rc, output = _sbatch(cluster, "-N2", "srun hostname; id -un", timeout=180)
    assert rc == 0, output
    assert output.count(cluster.rendered.admin_user) == 1, output


def test_autostop_deallocates_idle_nodes_and_a_job_starts_one_again(cluster: BootCluster) -> None:
    node_vms = [cluster.vms[name] for name in cluster.rendered.node_names]
    cluster.wait_for("idle nodes stopped", lambda: not any(vm.running() for vm in node_vms), 240)
    assert any(call.startswith("deallocate") for call in cluster.azure.calls), cluster.azure.calls
    rc, output = _sbatch(cluster, "-N1", "hostname", timeout=REBOOT_S + 60)
    assert rc == 0, output
    assert any(call.startswith("start") for call in cluster.azure.calls), cluster.azure.calls
