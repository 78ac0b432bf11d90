"""Per-GPU allocation on the local cluster's emulated GPUs (dtrain/local/gpus.py): Slurm's gres and
task/cgroup ConstrainDevices, for real. Two one-GPU jobs share a node at the same time, each able to
open only its own GPU's device, and each is recorded (run.json, sacct) with its one GPU; a job asking for
more GPUs than a node has is refused before submission."""

from __future__ import annotations

import json

from dtrain.local import gpus as local_gpus
from dtrain.local import slurm_conf
from tests.polling import wait_for

from .conftest import FIXTURES, local_state_dir, own_cluster, slurm_command
from .test_launcher import cli, run_dir, status_of


def test_two_one_gpu_jobs_share_a_node_each_seeing_only_its_own_gpu(tmp_path):
    with own_cluster(tmp_path, "g", nodes=1, gpus_per_node=2) as desc:
        cluster_file = local_state_dir(desc) / "cluster.json"
        devices = local_gpus.device_dir(slurm_conf.SlurmFiles(local_state_dir(desc)))
        rendezvous = tmp_path / "rendezvous"
        rendezvous.mkdir()
        launch = ["launch", "--cluster", str(cluster_file), "--workdir", str(FIXTURES / "gpu_probe"), "--gpus", "1"]
        command = ["--", "python", "probe.py", str(devices), str(rendezvous)]
        for run_id in ("gpu-a", "gpu-b"):
            proc = cli(*launch, "--run-id", run_id, "--detach", *command)
            assert proc.returncode == 0, proc.stderr
            assert "1 node x 1 of 2 GPUs (shared nodes, its own GPUs only)" in proc.stderr
        seen = {}
        for run_id in ("gpu-a", "gpu-b"):
            status = wait_for(lambda r=run_id: status_of(desc, r), 120, f"{run_id} to end", interval=0.5)
            assert status["exit_code"] == 0, (run_dir(desc, run_id) / "output.log").read_text()[-2000:]
            seen[run_id] = json.loads((run_dir(desc, run_id) / "output" / "probe.json").read_text())
            # charged its one GPU of the node's two (Slurm's allocation), not the whole node
            attempt = json.loads((run_dir(desc, run_id) / "run.json").read_text())["attempts"][-1]
            assert attempt["billed_by"] == "1 GPUs of 2 a node (allocated)" and attempt["billed_nodes"] == 0.5, attempt
            # AllocTRES counts the job's GPU (AccountingStorageTRES), and so does its record in slurmdbd
            assert "node=1" in attempt["alloc_tres"] and "gres/gpu=1" in attempt["alloc_tres"], attempt
            job_id = (run_dir(desc, run_id) / "job_id").read_text().strip()
            accounted = wait_for(
                lambda j=job_id: slurm_command(desc, "sacct", "-X", "-n", "-P", "-j", j, "--format=State,AllocTRES")
                .stdout.strip()
                .startswith("COMPLETED|"),
                60,
                f"job {job_id} in sacct",
                interval=0.5,
            )
            assert accounted
            sacct = slurm_command(desc, "sacct", "-X", "-n", "-P", "-j", job_id, "--format=AllocTRES").stdout
            assert "gres/gpu=1" in sacct.split(","), sacct
        assert all(probe["together"] for probe in seen.values()), seen  # both held node-0 at once
        assert sorted(probe["job_gpus"] for probe in seen.values()) == ["0", "1"], seen
        for probe in seen.values():  # its own GPU (no driver: ENXIO); the other job's is denied by its cgroup
            own, other = f"nvidia{probe['job_gpus']}", f"nvidia{1 - int(probe['job_gpus'])}"
            assert probe["devices"] == {own: "ENXIO", other: "EPERM"}, probe
            assert probe["cuda_visible_devices"] == "0"  # Slurm numbers the visible GPUs from 0
        # a request larger than a node: refused before anything is submitted; every GPU of it: the whole node
        too_many = cli(*launch[:-1], "3", "--run-id", "gpu-c", *command[:3])
        assert too_many.returncode == 2 and not run_dir(desc, "gpu-c").exists()
        assert too_many.stderr.strip().splitlines() == [
            # the cluster has one node: no advice to ask for two
            f"error: --gpus 3 asks for 3 GPUs on a node, and a node of cluster {desc.name} has 2: it has 1 node, "
            "2 GPUs in all"
        ]
        whole = cli(*launch[:-1], "2", "--dry-run", *command)
        assert whole.returncode == 0 and "#SBATCH --exclusive\n#SBATCH --mem=0\n#SBATCH --gres=gpu:2\n" in whole.stdout
