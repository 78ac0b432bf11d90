"""`status` shows every node's boot: the steps of node-setup that failed (with why), read from the boot
report the node writes to the shared file system (so it shows even when slurmd could not start)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from dtrain.cli.jobs import nodes_table, read_reports
from dtrain.cluster.slurm import NodeInfo
from dtrain.jobs.follow import nodes_booting

NVME_FAILED = "failed: nvme-raid: found 0 local NVMe disks (), expected 8 (0: one or more)"


class HereSlurm:
    """The login node's shell, run here: what read_reports asks of it."""

    def run_unchecked(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)


def test_status_names_the_node_and_the_setup_step_that_failed_even_when_slurmd_never_started(tmp_path: Path) -> None:
    boot, health = tmp_path / ".boot", tmp_path / ".health"
    boot.mkdir()
    health.mkdir()
    # node -000000 booted; -00000a's NVMe failed (slurmd runs all the same); -00000b's munge key never came
    # (slurmd could not start: Slurm still shows it idle~, powered down)
    (boot / "hvd-gpu-000000").write_text("nvme-raid=ok\nslurmd=ok\nok=1\nupdated_at=2026-11-27T20:00:00Z\n")
    (boot / "hvd-gpu-00000a").write_text(f"nvme-raid={NVME_FAILED}\nslurmd=ok\nok=0\n")
    (boot / "hvd-gpu-00000b").write_text(
        "nvme-raid=ok\nslurmd=failed: munge-key: could not read secret slurm-munge-key\nok=0\n"
    )
    (health / "hvd-gpu-000000").write_text("ok=1\ngpus ok\n")
    desc = SimpleNamespace(shared_mount_path=str(tmp_path))
    reports = read_reports(desc, HereSlurm())  # type: ignore[arg-type]
    assert reports["boot"]["hvd-gpu-00000a"]["nvme-raid"] == NVME_FAILED and "hvd-gpu-000000" in reports["health"]

    nodes = [
        NodeInfo(name="hvd-gpu-000000", state="idle", reason="none", cpus="96", gres="gpu:8"),
        NodeInfo(name="hvd-gpu-00000a", state="idle", reason="none", cpus="96", gres="gpu:8"),
        NodeInfo(name="hvd-gpu-00000b", state="idle~", reason="none", cpus="96", gres="gpu:8"),
        NodeInfo(
            name="hvd-gpu-00000c", state="idle~", reason="none", cpus="96", gres="gpu:8"
        ),  # never booted: no report
    ]
    console = Console(width=400, record=True)
    console.print(nodes_table(nodes, reports["health"], reports["boot"]))
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if "hvd-gpu-" in line}
    assert "ok" in rows["hvd-gpu-000000"] and "failed" not in rows["hvd-gpu-000000"]
    assert "failed nvme-raid: nvme-raid: found 0 local NVMe disks" in rows["hvd-gpu-00000a"]
    assert "failed slurmd: munge-key: could not read secret slurm-munge-key" in rows["hvd-gpu-00000b"]
    assert "powered down" in rows["hvd-gpu-00000b"] and "failed" not in rows["hvd-gpu-00000c"]


def test_no_boot_column_where_no_node_wrote_a_boot_report() -> None:
    """The local cluster's nodes run no node-setup: its status table stays as it was."""
    console = Console(width=400, record=True)
    console.print(nodes_table([NodeInfo("node-0", "idle", "none", "2", "")], {}, {}))
    assert "boot" not in console.export_text()


def test_a_node_slurm_lost_is_not_shown_as_on() -> None:
    """A node evicted unseen: its slurmd stopped answering (down*, drained* under the agent's drain). Until the
    head node's reaper has asked Azure and powered it down, its power is not known to be on."""
    console = Console(width=400, record=True)
    nodes = [
        NodeInfo("node-0", "down*", "Not responding", "2", ""),
        NodeInfo("node-1", "drained*", "spot eviction 4F2A", "2", ""),
        NodeInfo("node-2", "idle~", "none", "2", ""),
        NodeInfo("node-3", "allocated", "none", "2", ""),
    ]
    console.print(nodes_table(nodes, {}, {}))
    power = {
        line.split()[1]: line.split("│")[3].strip() for line in console.export_text().splitlines() if "node-" in line
    }
    assert power == {"node-0": "not responding", "node-1": "not responding", "node-2": "powered down", "node-3": "on"}


def test_a_booting_node_shows_the_step_it_is_in_in_status_and_in_launch_follow(tmp_path: Path) -> None:
    """Boot progress from the boot steps' own reports: which step of how many, since when."""
    boot = tmp_path / ".boot"
    boot.mkdir()
    since = "running since 2026-11-28T00:01:02Z"
    (boot / "hvd-gpu-000001").write_text(f"nfs-mount=ok\nnvme-raid=ok\nslurmd={since}\nspot-agent=pending\nok=0\n")
    (boot / "hvd-gpu-000002").write_text("nfs-mount=ok\nslurmd=ok\nok=1\n")
    desc = SimpleNamespace(shared_mount_path=str(tmp_path))
    reports = read_reports(desc, HereSlurm())  # type: ignore[arg-type]
    console = Console(width=400, record=True)
    nodes = [NodeInfo(name=f"hvd-gpu-00000{n}", state="idle#", reason="none", cpus="96", gres="gpu:8") for n in (1, 2)]
    console.print(nodes_table(nodes, {}, reports["boot"]))
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if "hvd-gpu-" in line}
    assert f"step 3 of 4, slurmd ({since}); 2 done" in rows["hvd-gpu-000001"]

    class JobSlurm(HereSlurm):
        def job_nodes(self, job_id: str) -> list[str]:
            return ["hvd-gpu-000001", "hvd-gpu-000002"]

    # `launch --follow` while the job is CONFIGURING: the node still booting, not the one that is up
    news = nodes_booting(desc, JobSlurm(), "7")  # type: ignore[arg-type]
    assert news == f"; hvd-gpu-000001 step 3 of 4, slurmd ({since}); 2 done"


def test_status_shows_the_check_that_drained_a_node_and_what_it_measured() -> None:
    """Azure's checks failed at the node's boot: its reason and its health column name the check and its figure."""
    failure = "check_ib_bw_gdr: IB=mlx5_ib3, IB BW (expected > 380 Gbps, but measured 191 Gbps). FaultCode: NHC2003"
    reason = f"health-check: azurehpc-health-checks: {failure}"
    report = {"ok": "0", "gpus": "ok", "infiniband": "ok", "azure_checks": f"azurehpc-health-checks: {failure}",
              "shared": "ok", "disk": "ok", "reason": reason}  # fmt: skip
    console = Console(width=800, record=True)
    console.print(
        nodes_table([NodeInfo("hvd-gpu-000001", "drained", reason, "96", "gpu:8")], {"hvd-gpu-000001": report}, {})
    )
    (row,) = [line for line in console.export_text().splitlines() if "hvd-gpu-000001" in line]
    assert reason in row
    assert f"failed gpus ok; infiniband ok; azure_checks azurehpc-health-checks: {failure}; shared ok; disk ok" in row
