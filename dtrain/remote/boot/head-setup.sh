#!/bin/bash
# Setup of the head node, run by head-setup.service at every boot (and every 30 minutes) until every
# step has succeeded once: the accounting database's disk, the packages, the cluster's munge key,
# slurmdbd, slurmctld (the nodes fetch their configuration from it), then the shared file system, where
# the operator's jobs keep their scripts and logs. A step runs whatever the shared file system does
# (boot-steps.sh), but not before what it needs: MariaDB's package only onto its disk, slurmdbd only
# with the munge key, slurmctld only with slurmdbd (it refuses to start without it). The munge key's
# and the database password's fetches retry for 45 minutes themselves (a new role assignment can
# take 30 to propagate). Exit status 0 when every step succeeded, 1 otherwise.
set -uo pipefail

SLURM_USER=@SLURM_USER@
SLURM_DIRS=@SLURM_DIRS@
SHARED_MOUNT=@SHARED_MOUNT@
# The program that mounts it (nfs-mount or lustre-mount), and the datasets' directory to make there
# ("": the NFS server makes it, or Lustre imports the datasets at its root).
MOUNT_PROGRAM=@MOUNT_PROGRAM@
DATA_DIR=@DATA_DIR@
RUNS_DIR=@RUNS_DIR@
RUNS_OWNER=@RUNS_OWNER@
USERS_DIR=@USERS_DIR@
USERS_LIST=@USERS_LIST@
USERS_SEED=@USERS_SEED@
REPORT_DIR=@REPORT_DIR@
PACKAGES=@PACKAGES@
readonly MUNGE_KEY=/usr/local/sbin/munge-key
readonly DATABASE_DISK=/usr/local/sbin/database-disk
readonly SLURMDBD_SETUP=/usr/local/sbin/slurmdbd-setup
readonly STEPS_DIR=/run/head-setup
readonly DONE_FILE=/var/lib/head-setup/done
readonly STEPS=(database-disk packages munge slurmdbd slurmctld shared-runs)
NODE_NAME=$(hostname -s | tr '[:upper:]' '[:lower:]')

log() { echo "head-setup: $*" >&2; }

# include boot-steps.sh
# include packages.sh

# Runs "$@" once step $1 has succeeded in this boot; else says which step it waits for.
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
after() {
  local needed=$1
  shift
  step_ok "$needed" || { log "waits for step $needed"; return 1; }
  "$@"
}

# The database's disk, where MariaDB runs on this node (DATABASE_DISK is there only then).
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
database_disk() {
  [[ ! -x $DATABASE_DISK ]] || "$DATABASE_DISK"
}

# The munge package started munged with a key of its own: the cluster's comes from Key Vault.
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
cluster_munge_key() {
  "$MUNGE_KEY" && systemctl restart munge
}

# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
start_slurmdbd() {
  install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0750 "${SLURM_DIRS[@]}" && "$SLURMDBD_SETUP"
}

# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
start_slurmctld() {
  install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0750 "${SLURM_DIRS[@]}" &&
    systemctl enable slurmctld &&
    systemctl restart slurmctld
}

# runs/ holds every job's run directory, made by its submitter (mode 0700). It belongs to the admin
# user, who submits the jobs: nothing on the shared file system is world-writable until the users list
# names someone (apply-users then opens runs/ to every person, sticky: each run is its maker's). Slurm
# runs a job under its submitter's uid on the nodes, and that uid is the same everywhere: Azure creates
# the admin user first on every machine, and apply-users gives each person the list's uid.
# The head node keeps the users list: the stack config's seeds it once, `dtrain users` changes it after.
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
shared_runs() {
  "$MOUNT_PROGRAM" && install -d -o "$RUNS_OWNER" -m 0755 "$SHARED_MOUNT/$RUNS_DIR" &&
    { [[ -z $DATA_DIR ]] || install -d -m 0755 "$DATA_DIR"; } &&
    install -d -m 0755 "$SHARED_MOUNT/$USERS_DIR" &&
    { [[ -e $SHARED_MOUNT/$USERS_DIR/$USERS_LIST ]] ||
      install -m 0644 "$USERS_SEED" "$SHARED_MOUNT/$USERS_DIR/$USERS_LIST"; } &&
    systemctl enable --now dtrain-users.timer dtrain-users.service
}

mkdir -p "$STEPS_DIR" "$(dirname "$DONE_FILE")"
# First (after the database's disk): the daemons, the shared file system, Prometheus and MLflow's
# environment need the packages.
step database-disk database_disk
# MariaDB's package makes its data directory as it installs: on its disk, never under the mount point
step packages after database-disk install_packages
step munge after packages cluster_munge_key
step slurmdbd after munge start_slurmdbd
step slurmctld after slurmdbd start_slurmctld
step shared-runs shared_runs
if all_steps_ok; then
  touch "$DONE_FILE"
  exit 0
fi
exit 1
