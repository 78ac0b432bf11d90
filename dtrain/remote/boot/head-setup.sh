#!/bin/bash
# First-boot setup of the head node: slurmctld first (the nodes fetch their configuration from
# it), then the shared file system, where the operator's jobs keep their scripts and logs. Safe to
# re-run.
set -euo pipefail

SLURM_USER=@SLURM_USER@
SLURM_DIRS=@SLURM_DIRS@
RUNS_DIR=@RUNS_DIR@
RUNS_OWNER=@RUNS_OWNER@
readonly NFS_MOUNT=/usr/local/sbin/nfs-mount
readonly MUNGE_KEY=/usr/local/sbin/munge-key

install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0750 "${SLURM_DIRS[@]}"
# The munge package started munged with a key of its own: the cluster's comes from Key Vault.
"$MUNGE_KEY"
systemctl restart munge
systemctl enable slurmctld
systemctl restart slurmctld
"$NFS_MOUNT"
# runs/ holds every job's run directory, made by its submitter (mode 0700). It belongs to the admin
# user, who submits the jobs: nothing on the shared file system is world-writable. Slurm runs a job
# under its submitter's uid on the nodes, and that uid is the same everywhere: Azure creates the
# admin user first on every machine.
install -d -o "$RUNS_OWNER" -m 0755 "$RUNS_DIR"
