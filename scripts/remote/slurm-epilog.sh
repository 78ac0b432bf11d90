#!/bin/bash
# Slurm's Epilog: slurmd runs it as root on every node of a job's allocation after the job ends
# (completed, failed, cancelled, timed out or requeued), with SLURM_JOB_ID in the environment.
#
# A job's training containers are started by its steps through dockerd, so they are dockerd's
# children, not the job's: Slurm's own kill never reaches them. The job script labels each one
# (docker run --label slurm.job=$SLURM_JOB_ID), and this removes every container with the label,
# so that the next job finds the node's GPUs and ports free. A node without docker, or without a
# docker daemon, has nothing to remove.
#
# A non-zero exit makes Slurm drain the node: that happens only when a container of the job may
# still be there (docker present but not answering, or a container that would not go).
set -uo pipefail

# slurmd sets no search path for its prologs and epilogs.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
readonly LABEL=slurm.job
readonly DOCKER_SOCKET=/var/run/docker.sock
# A daemon that stopped answering must not hold the node in COMPLETING for ever.
readonly DOCKER_SECONDS=60

log() { echo "slurm-epilog: $*" >&2; }

job=${SLURM_JOB_ID:-}
if [[ ! $job =~ ^[0-9]+$ ]]; then
  log "SLURM_JOB_ID is '$job', not a job id; run by slurmd as the Epilog only"
  exit 1
fi
if ! command -v docker >/dev/null 2>&1 || [ ! -S "$DOCKER_SOCKET" ]; then
  exit 0
fi

# Prints the ids of the job's containers, one per line; fails when docker does not answer.
job_containers() {
  timeout -k 5 "$DOCKER_SECONDS" docker ps --all --quiet --filter "label=$LABEL=$job"
}

if ! found=$(job_containers); then
  log "docker did not list the containers of job $job"
  exit 1
fi
[ -n "$found" ] || exit 0
mapfile -t ids <<<"$found"
# A container that ends on its own meanwhile makes rm fail for it: what counts is that none is left.
timeout -k 5 "$DOCKER_SECONDS" docker rm --force "${ids[@]}" >/dev/null
if ! left=$(job_containers); then
  log "docker did not answer after removing the containers of job $job"
  exit 1
elif [ -n "$left" ]; then
  log "containers of job $job are still there: ${left//$'\n'/ }"
  exit 1
fi
log "removed ${#ids[@]} container(s) of job $job"
