#!/bin/bash
# Setup of the head node, run by head-setup.service at every boot (and every 30 minutes) until every
# step has succeeded once: the packages, slurmctld (the nodes fetch their configuration from it), then
# the shared file system, where the operator's jobs keep their scripts and logs. The steps are
# independent (boot-steps.sh): a shared file system that is late does not keep slurmctld from
# starting. The munge key's fetch retries for 45 minutes itself (a new role assignment can take 30
# to propagate). Exit status 0 when every step succeeded, 1 otherwise.
set -uo pipefail

SLURM_USER=@SLURM_USER@
SLURM_DIRS=@SLURM_DIRS@
SHARED_MOUNT=@SHARED_MOUNT@
RUNS_DIR=@RUNS_DIR@
RUNS_OWNER=@RUNS_OWNER@
REPORT_DIR=@REPORT_DIR@
PACKAGES=@PACKAGES@
readonly NFS_MOUNT=/usr/local/sbin/nfs-mount
readonly MUNGE_KEY=/usr/local/sbin/munge-key
readonly STEPS_DIR=/run/head-setup
readonly DONE_FILE=/var/lib/head-setup/done
readonly STEPS=(packages slurmctld shared-runs)
NODE_NAME=$(hostname -s | tr '[:upper:]' '[:lower:]')

log() { echo "head-setup: $*" >&2; }

# include boot-steps.sh
# include packages.sh

# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
start_slurmctld() {
  install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0750 "${SLURM_DIRS[@]}" &&
    # The munge package started munged with a key of its own: the cluster's comes from Key Vault.
    "$MUNGE_KEY" &&
    systemctl restart munge &&
    systemctl enable slurmctld &&
    systemctl restart slurmctld
}

# runs/ holds every job's run directory, made by its submitter (mode 0700). It belongs to the admin
# user, who submits the jobs: nothing on the shared file system is world-writable. Slurm runs a job
# under its submitter's uid on the nodes, and that uid is the same everywhere: Azure creates the
# admin user first on every machine.
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
shared_runs() {
  "$NFS_MOUNT" && install -d -o "$RUNS_OWNER" -m 0755 "$SHARED_MOUNT/$RUNS_DIR"
}

mkdir -p "$STEPS_DIR" "$(dirname "$DONE_FILE")"
# First: slurmctld, the shared file system, Prometheus and MLflow's environment need the packages.
step packages install_packages
step slurmctld start_slurmctld
step shared-runs shared_runs
if all_steps_ok; then
  touch "$DONE_FILE"
  exit 0
fi
exit 1
