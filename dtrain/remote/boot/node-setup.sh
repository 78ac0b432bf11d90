#!/bin/bash
# Setup of a GPU node, run by node-setup.service at every boot (and every 30 minutes) until every
# step has succeeded once, the packages first. The steps are independent: each runs whatever became
# of the others, so a failed optional step (the NVMe volume, the registry login) never keeps slurmd
# from starting. Each step's result goes to the boot report (boot-steps.sh), which `dtrain status`
# shows. The steps that call Azure with the node's identity retry for 45 minutes themselves (a new
# role assignment can take 30 to propagate); the others are tried again at the next run. Exit status
# 0 when every step succeeded (node-setup.service then stops running it), 1 otherwise.
set -uo pipefail

SHARED_MOUNT=@SHARED_MOUNT@
# The shared file system's boot step (nfs-mount or lustre-mount), and the program of that name.
MOUNT_STEP=@MOUNT_STEP@
REPORT_DIR=@REPORT_DIR@
ADMIN_USER=@ADMIN_USER@
DOCKER_GROUP=@DOCKER_GROUP@
PACKAGES=@PACKAGES@
AZURE_CHECKS_RESULT=@AZURE_CHECKS_RESULT@ # the verdict of Azure's checks at this boot (azure-health-checks.sh)
readonly STEPS_DIR=/run/node-setup
readonly DONE_FILE=/var/lib/node-setup/done
readonly STEPS=(packages "$MOUNT_STEP" users nccl-conf nvme-raid docker-group registry-login azure-checks slurmd spot-agent gpu-metrics)
# Slurm's name for this machine: Azure may write the scale set's base-36 digits in upper case.
NODE_NAME=$(hostname -s | tr '[:upper:]' '[:lower:]')

log() { echo "node-setup: $*" >&2; }

# include boot-steps.sh
# include packages.sh

# The first login in this run (it retries while the AcrPull assignment propagates). The timer renews
# it hourly from now on, not only from the next boot (the token lasts about 3 hours); at every later
# boot acr-login-boot.service logs in again before slurmd starts: a resumed node's login has expired.
# The timer first: started after its OnBootSec, it starts acr-login.service at once, which
# `systemctl start` then waits for.
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
registry_login() {
  systemctl enable acr-login-boot.service &&
    systemctl enable --now acr-login.timer &&
    systemctl start acr-login.service
}

# Azure's checks for the size, enabled for every later boot too (the unit runs before slurmd, and a node
# Azure starts again may be on other hardware). When they fail, the boot report says what failed: the
# unit's verdict, not systemctl's "Job ... failed".
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
azure_checks() {
  systemctl enable azure-health-checks.service || return 1
  systemctl start azure-health-checks.service && return 0
  local verdict
  verdict=$(head -n 1 "$AZURE_CHECKS_RESULT" 2>/dev/null) || verdict="no verdict recorded"
  echo "azure-health-checks: ${verdict#failed: }" >&2
  return 1
}

mkdir -p "$STEPS_DIR" "$(dirname "$DONE_FILE")"
systemctl daemon-reload
# First: the shared mount, the NVMe volume and slurmd need the packages (each fails without them, and
# the next run tries again).
step packages install_packages
step "$MOUNT_STEP" "$MOUNT_STEP"
# The people's accounts (the users list on the shared file system, same uids everywhere) before slurmd
# takes their jobs; applied again every 30 s, and at every later boot before slurmd.
step users systemctl enable --now dtrain-users.timer dtrain-users.service
step nccl-conf systemctl enable --now nccl-conf.service
# Enabled for every later boot too: a deallocated node starts again with empty NVMe disks.
step nvme-raid systemctl enable --now nvme-raid.service
# Docker-runtime jobs run `docker run` as the admin user, who submits them: before slurmd, which
# reads a job's groups on the node (slurm.conf: LaunchParameters=disable_send_gids).
step docker-group usermod -aG "$DOCKER_GROUP" "$ADMIN_USER"
# In the background: slurmd does not wait for the registry (host-runtime jobs never need it).
step registry-login registry_login &
registry=$!
# Before slurmd: its first health check, before the node registers, drains it if Azure's checks failed,
# with the failed check and its figure as the reason. slurmd starts all the same, so that Slurm says why.
step azure-checks azure_checks
step slurmd slurmd-setup
# Turns a Spot eviction notice (Scheduled Events) into a checkpoint and a requeue; idle on on-demand nodes.
step spot-agent systemctl enable --now spot-agent.service
# The GPUs' metrics for the head node's Prometheus (node_exporter's package started it at install).
step gpu-metrics systemctl enable --now dcgm-exporter.service
wait "$registry"
if all_steps_ok; then
  touch "$DONE_FILE"
  exit 0
fi
exit 1
