"""The Azure cluster's own custom data, booted by cloud-init in VMs under software emulation
(`make test-boot-vm`, opt-in): what system containers cannot show (tests/boot/containers.py's
EXCLUSIONS), above all the NFS server role with its RAID, XFS and kernel nfsd.

The NFS server, the head node and two GPU nodes boot what the Pulumi program renders (with the
substitutions the test prints), against Azure's endpoints served on the VMs' network. Runs as root,
only when DTRAIN_BOOT_VM=1 (the Makefile target sets it): it takes up to half an hour on 2 cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import yaml

from tests.boot.cluster import BootCluster, assert_nothing_left, boot_cluster

pytestmark = pytest.mark.skipif(
    os.environ.get("DTRAIN_BOOT_VM") != "1" or os.geteuid() != 0,
    reason="the VM boot test runs with `make test-boot-vm` (DTRAIN_BOOT_VM=1), as root",
)
KEY_VAULT_FORBIDDEN_S = 60  # the second node's first minute: Key Vault answers 403, as before RBAC propagates
BOOT_S = 900  # every VM's first boot, in software emulation on 2 shared cores
REBOOT_S = 420


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootCluster]:
    started = time.monotonic()
    work = tmp_path_factory.mktemp("boot")
    with boot_cluster(work, kind="vm", forbid_vault_s={1: KEY_VAULT_FORBIDDEN_S}) as booted:
        print("\nsubstitutions in the custom data:")
        for edit in booted.rendered.substitutions:
            print(f"  {edit}")
        yield booted
        namespace = booted.hub.name
    assert_nothing_left(work, namespace)
    print(f"\nboot test: {time.monotonic() - started:.0f} s")


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
    cluster.wait_for("both nodes registered", lambda: all(cluster.ready(name) for name in names), BOOT_S)
    for name in names:
        fields = cluster.nodes()[name]
        assert fields["Gres"] == "gpu:8", fields
        assert (fields["CPUTot"], fields["RealMemory"]) == ("1", "768"), fields


def test_a_node_whose_key_vault_refused_at_first_still_joined(cluster: BootCluster) -> None:
    assert cluster.azure.refusals.get("10.40.0.5", 0) >= 1, "Key Vault never refused the second node"
    assert cluster.ready(cluster.rendered.node_names[1])


def test_a_two_node_job_runs_as_the_admin_user(cluster: BootCluster) -> None:
    rc, output = cluster.sbatch("-N2", "srun hostname; id -un", timeout=180)
    assert rc == 0, output
    assert output.count(cluster.rendered.admin_user) == 1, output


def test_autostop_deallocates_idle_nodes_and_a_job_starts_one_again(cluster: BootCluster) -> None:
    node_vms = [cluster.hosts[name] for name in cluster.rendered.node_names]
    cluster.wait_for("idle nodes stopped", lambda: not any(vm.running() for vm in node_vms), 240)
    assert any(call.startswith("deallocate") for call in cluster.azure.calls), cluster.azure.calls
    rc, output = cluster.sbatch("-N1", "hostname", timeout=REBOOT_S + 60)
    assert rc == 0, output
    assert any(call.startswith("start") for call in cluster.azure.calls), cluster.azure.calls
