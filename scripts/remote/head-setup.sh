#!/bin/bash
# First-boot setup of the head node: slurmctld first (the nodes fetch their configuration from
# it), then the shared file system, where the operator's jobs keep their scripts and logs. Safe to
# re-run.
set -euo pipefail

SLURM_USER=@SLURM_USER@
SLURM_DIRS=@SLURM_DIRS@
readonly NFS_MOUNT=/usr/local/sbin/nfs-mount

install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0750 "${SLURM_DIRS[@]}"
# The munge package started munged with a key of its own; cloud-init put the cluster's in place after.
systemctl restart munge
systemctl enable slurmctld
systemctl restart slurmctld
"$NFS_MOUNT"
