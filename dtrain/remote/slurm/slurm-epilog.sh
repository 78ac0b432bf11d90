#!/bin/bash
# Slurm's Epilog: slurmd runs it as root on every node of a job's allocation after the job ends
# (completed, failed, cancelled, timed out or requeued), with SLURM_JOB_ID in the environment.
# The job stays COMPLETING until it has run on every node, so a job that has left the queue has
# nothing left on its nodes (or its node is drained, with the reason).
#
# Slurm tracks a job's processes through /proc's parent links (proctrack/linuxproc: Slurm 21.08
# cannot use cgroup v2), and loses a process whose parent died before it: it is adopted by init,
# and survives the job (a killed rank's decode workers). Each still carries the job's SLURM_JOB_ID
# in its environment (with SLURM_CLUSTER_NAME: job ids are per cluster, and the local cluster's
# nodes share one process table with any other local cluster on the machine), so this kills every
# process that carries both. Jobs that share the node have other ids, and are left alone.
#
# A job's training containers are started by its steps through dockerd, so they are dockerd's
# children, not the job's: Slurm's own kill never reaches them. The job script labels each one
# (docker run --label slurm.job=$SLURM_JOB_ID), and this removes every container with the label,
# so that the next job finds the node's GPUs and ports free. A node without docker, or without a
# docker daemon, has nothing to remove.
#
# It also takes the job's id out of the DCGM exporter's job mapping (written by slurm-prolog.sh), so that
# the GPUs' series stop carrying the label hpc_job="<id>" of a job that has ended.
#
# A non-zero exit makes Slurm drain the node: that happens only when a process or a container of
# the job may still be there (one that survives SIGKILL, docker present but not answering, or a
# container that would not go).
set -uo pipefail

# slurmd sets no search path for its prologs and epilogs.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
readonly LABEL=slurm.job
readonly DOCKER_SOCKET=/var/run/docker.sock
# A daemon that stopped answering must not hold the node in COMPLETING for ever.
readonly DOCKER_SECONDS=60
# A killed process in uninterruptible sleep (a hung NFS read) ends when the read does, or never.
readonly STRAY_SECONDS=10
readonly PROC=/proc

log() { echo "slurm-epilog: $*" >&2; }

job=${SLURM_JOB_ID:-}
if [[ ! $job =~ ^[0-9]+$ ]]; then
  log "SLURM_JOB_ID is '$job', not a job id; run by slurmd as the Epilog only"
  exit 1
fi
cluster=${SLURM_CLUSTER_NAME:-}
# Our own children must not carry it: only this shell's own environment still does.
unset SLURM_JOB_ID

# Every GPU file that names the job (not only SLURM_JOB_GPUS's: a file left by a lost epilog goes too).
readonly MAPPING_DIR=${DCGM_HPC_JOB_MAPPING_DIR:-/run/dcgm-job-map}
for file in "$MAPPING_DIR"/*; do
  if [ ! -f "$file" ] || ! grep -qxF "$job" "$file"; then
    continue
  fi
  others=$(grep -vxF "$job" "$file")
  if [ -n "$others" ]; then
    printf '%s\n' "$others" >"$file"
  else
    rm -f "$file"
  fi
done

# /proc/PID/stat's fields after the command name: state, parent, process group, ...
stat_fields() {
  local stat
  read -r stat 2>/dev/null <"$1/stat" || return 1
  echo "${stat##*) }"
}
# This script's subshells keep its environment (SLURM_JOB_ID): its process group tells them apart.
read -r _ _ own_group _ <<<"$(stat_fields "$PROC/$$")"

# Prints the pids of the live processes of the job (not zombies: they hold nothing), one per line.
job_processes() {
  local entry state group environ
  for entry in "$PROC"/[0-9]*; do
    read -r state _ group _ <<<"$(stat_fields "$entry")" || continue
    [[ $state == [ZX] || $group == "$own_group" ]] && continue
    environ=$(tr '\0' '\n' 2>/dev/null <"$entry/environ") || continue
    grep -qxF "SLURM_JOB_ID=$job" <<<"$environ" || continue
    if [ -z "$cluster" ] || grep -qxF "SLURM_CLUSTER_NAME=$cluster" <<<"$environ"; then
      echo "${entry##*/}"
    fi
  done
}

mapfile -t strays < <(job_processes)
if [ "${#strays[@]}" -gt 0 ]; then
  kill -KILL "${strays[@]}" 2>/dev/null
  for _ in $(seq "$STRAY_SECONDS"); do
    [ -z "$(job_processes)" ] && break
    sleep 1
  done
  if left=$(job_processes) && [ -n "$left" ]; then
    log "processes of job $job survived SIGKILL: ${left//$'\n'/ }"
    exit 1
  fi
  log "killed ${#strays[@]} process(es) of job $job that Slurm had lost track of"
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
