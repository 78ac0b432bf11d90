"""The names infra/ and the operator CLI (dtrain/) share: stack outputs, paths, ports, frameworks.

Standard library only, so that the CLI can import it without Pulumi or pydantic. A value that both
sides read lives here once; changing one is a change of the contract between the two.
"""

from __future__ import annotations

from enum import StrEnum

from training.exit_status import ExitCode

# Where every node and the head node mount the NFS export. Not under /mnt: Azure mounts the VM's
# temporary disk there at boot, which would hide it.
SHARED_MOUNT_PATH = "/shared"
DATA_DIR_NAME = "data"  # the datasets' directory beneath the shared mount (but where Lustre imports them)
DATA_PATH = f"{SHARED_MOUNT_PATH}/{DATA_DIR_NAME}"
# Beneath the shared mount (SHARED_MOUNT_PATH on Azure; the local cluster's is elsewhere):
RUNS_DIR = "runs"  # runs/<run_id>/: one job's files, made by its submitter (mode 0700)
WORKDIRS_DIR = ".workdirs"  # runs/.workdirs/<user>-<dir>-<hash>/: the last upload of a user's --workdir (0700)
HEALTH_REPORT_DIR = ".health"  # .health/<node>: the node health check's last result (root's, 0644)
BOOT_REPORT_DIR = ".boot"  # .boot/<node>: each setup step's result at the machine's last boot (root's, 0644)
# Where a GPU node mounts the RAID 0 over its local NVMe disks (emptied by every deallocation).
# Not under /mnt, for the same reason as the shared mount.
NVME_MOUNT_PATH = "/nvme"
# A GPU node's OS disk (GB): room for the framework images; what a task file's disk_size is checked against
GPU_NODE_OS_DISK_GB = 256

SSH_PORT = 22
CONTAINER_SSH_PORT = 12345  # sshd inside the training containers (horovodrun between nodes)
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
SLURMDBD_PORT = 6819  # slurmdbd, beside slurmctld on the head node: slurmctld and sacct on the head reach it
MLFLOW_PORT = 5000  # the head node's MLflow tracking server (VNet only), and the local head namespace's
# Every `mlflow server` of ours: MLflow 3 reports usage to its maintainers unless told not to, and starts 7
# job-runner processes (each importing MLflow, ~200 MB) for GenAI features that experiment tracking never uses.
MLFLOW_SERVER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}
# Lustre's LNet: the file system's servers listen on 988, and a client connects to them from a privileged
# port of this range (Azure Managed Lustre's prerequisites name both).
LUSTRE_PORT = 988
LUSTRE_CLIENT_PORTS = "1019-1023"
# srun listens on ports from this range (slurm.conf SrunPortRange), so that a firewall can name them.
SRUN_PORT_RANGE = (60001, 63000)
SRUN_PORTS = "{}-{}".format(*SRUN_PORT_RANGE)  # as slurm.conf and the network rules write it
# Telemetry (infra/cloud_init/prometheus.py): Prometheus on the head node scrapes the exporters on every node.
PROMETHEUS_PORT = 9090
NODE_EXPORTER_PORT = 9100
DCGM_EXPORTER_PORT = 9400
PROMETHEUS_NODE_LABEL = "node"  # every scrape target's Slurm node name: how a query names a job's nodes

SLURM_PARTITION = "gpu"
# Spot nodes' partition (`launch --spot`): their jobs are requeued, and resume, after an eviction.
SPOT_PARTITION = "spot"
# A job's exit status after it saved a checkpoint for an eviction (the one exit table, training/exit_status.py).
PREEMPTED_EXIT_CODE = int(ExitCode.PREEMPTED)
# A job ended by a cancel or its time limit closes its run (status, run.json, MLflow, the upload) between
# Slurm's SIGTERM and its SIGKILL (KillWait): the batch script first gives its launcher this long to end
# (srun alone may take KillWait + 2 s), then closes; at least this much of KillWait is left for the closing.
LAUNCH_END_WAIT_S = 10
MIN_CLOSING_S = 20
# The container registry's tier: the stack deploys it, `python -m dtrain cost` prices it.
REGISTRY_SKU = "Standard"
FRAMEWORKS = ("pytorch", "tensorflow", "keras")
# Below this much free space where images and job data land, a node is not fit for a job.
MIN_FREE_DISK_GB = 50


class StackOutput(StrEnum):
    """Every output of the Azure stack (`pulumi stack output --json --show-secrets`)."""

    RESOURCE_GROUP = "resource_group"
    DATA_RESOURCE_GROUP = "data_resource_group"  # storage: kept by `pulumi destroy` (delete it deliberately)
    LOCATION = "location"
    JUMPBOX_PUBLIC_IP = "jumpbox_public_ip"
    ADMIN_USER = "admin_user"
    HEAD_PRIVATE_IP = "head_private_ip"  # the Slurm controller and login node, reached through the jumpbox
    HEAD_HOSTNAME = "head_hostname"
    SLURM_CLUSTER_NAME = "slurm_cluster_name"
    SLURM_PARTITION = "slurm_partition"
    SPOT_PARTITION = "spot_partition"  # None when the stack has no Spot nodes
    DEFAULT_JOB_TIME = "default_job_time"  # every partition's DefaultTime (defaultJobTime)
    MAX_JOB_TIME = "max_job_time"  # every partition's MaxTime (maxJobTime): INFINITE, or a time limit
    SHARED_STORAGE = "shared_storage"  # nfs or lustre (sharedStorage); absent in stacks from before it: nfs
    NFS_PRIVATE_IP = "nfs_private_ip"  # None with Lustre
    NFS_EXPORT_PATH = "nfs_export_path"  # None with Lustre
    LUSTRE_MGS_ADDRESS = "lustre_mgs_address"  # the Lustre file system's management service; None with NFS
    SHARED_MOUNT_PATH = "shared_mount_path"
    DATA_PATH = "data_path"
    LOCAL_DATA_PATH = "local_data_path"  # on each GPU node's NVMe: `launch --local-copy` copies datasets there
    STORAGE_ACCOUNT = "storage_account"
    BLOB_ENDPOINT = "blob_endpoint"
    # where `results` lives: blob_endpoint, or the kept account's (keptResultsAccount)
    RESULTS_BLOB_ENDPOINT = "results_blob_endpoint"
    DATA_CONTAINER = "data_container"
    RESULTS_CONTAINER = "results_container"
    DATA_SAS = "data_sas"  # the only secret output
    ACR_LOGIN_SERVER = "acr_login_server"
    SCALE_SET_NAME = "scale_set_name"
    NODE_COUNT = "node_count"
    GPUS_PER_NODE = "gpus_per_node"
    GPU_SKU = "gpu_sku"
    CLUSTER_IDENTITY_CLIENT_ID = "cluster_identity_client_id"
    NCCL_ENV = "nccl_env"
