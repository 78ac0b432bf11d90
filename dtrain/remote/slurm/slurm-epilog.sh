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
# A job of several nodes measures them before it trains (the gate: dtrain/jobs/node_gate.py), and
# requeues itself when one is slow; a job may not drain a node, so this does it, for this node only,
# with the figure its own gate process measured (see drain_after_gate), and leaves the figures for
# node_exporter's textfile collector, so that Prometheus keeps each node's history.
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

# The gate's file for this node (<run>/gate/<node>, key=value lines) is the job user's: it is never
# followed through a link nor read past 4 KB or 5 s, and only names and numbers that match a pattern are
# taken from it (the reason is rebuilt from them). A user can forge it to drain a node of their own
# job, no other; the reason names the job.
readonly GATE_SUBDIR=gate
readonly TEXTFILE_DIR=${NODE_TEXTFILE_DIR:-/var/lib/prometheus/node-exporter}
readonly NUMBER='^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$'
gate_value() { grep -m1 "^$1=" <<<"$2" | cut -d= -f2-; }
drain_after_gate() {
  local node=${SLURMD_NODENAME:-} workdir dir file text key figure unit reason="" metrics tmp
  # slurmd names the node; without its name or Slurm's commands there is no gate to read
  [ -n "$node" ] && command -v scontrol >/dev/null 2>&1 || return 0
  workdir=$(timeout -k 2 10 scontrol show job "$job" 2>/dev/null | grep -o 'WorkDir=[^ ]*' | cut -d= -f2-)
  dir=$workdir/$GATE_SUBDIR
  file=$dir/$node
  [[ -n $workdir && -d $dir && ! -L $dir && -f $file && ! -L $file ]] || return 0
  text=$(timeout -k 1 5 head -c 4096 "$file") || return 0
  for key in node_value node_min link_gbs link_min job_allreduce_gbs; do
    [[ $(gate_value "$key" "$text") =~ $NUMBER ]] || { log "job $job's gate file for $node is not ours: $key" && return 0; }
  done
  figure=$(gate_value node_figure "$text")
  [[ $figure =~ ^(matmul|allreduce)$ ]] || return 0
  unit=GB/s
  [ "$figure" = matmul ] && unit=GFLOP/s
  if [[ ,$(gate_value failed "$text"), == *,node,* ]]; then
    reason+="; $figure $(gate_value node_value "$text") $unit < $(gate_value node_min "$text")"
  fi
  if [[ ,$(gate_value failed "$text"), == *,link,* ]]; then
    reason+="; link $(gate_value link_gbs "$text") GB/s < $(gate_value link_min "$text")"
  fi
  if [ -d "$TEXTFILE_DIR" ] && tmp=$(mktemp "$TEXTFILE_DIR/.dtrain_gate.XXXXXX"); then
    metrics="# HELP dtrain_gate_link_gbps What the node sent to the next node at the last job gate, GB/s.
# TYPE dtrain_gate_link_gbps gauge
dtrain_gate_link_gbps{node=\"$node\"} $(gate_value link_gbs "$text")
# HELP dtrain_gate_node_figure The node's own figure at the last job gate (unit: GB/s all-reduce or GFLOP/s).
# TYPE dtrain_gate_node_figure gauge
dtrain_gate_node_figure{node=\"$node\",figure=\"$figure\",unit=\"$unit\"} $(gate_value node_value "$text")
# HELP dtrain_gate_job_allreduce_gbps All-reduce bus bandwidth across the job's nodes at the last gate, GB/s.
# TYPE dtrain_gate_job_allreduce_gbps gauge
dtrain_gate_job_allreduce_gbps{node=\"$node\"} $(gate_value job_allreduce_gbs "$text")
# HELP dtrain_gate_passed Whether the node passed the last job gate.
# TYPE dtrain_gate_passed gauge
dtrain_gate_passed{node=\"$node\"} $([ -z "$reason" ] && echo 1 || echo 0)
# HELP dtrain_gate_timestamp_seconds When the last job gate's figures were recorded.
# TYPE dtrain_gate_timestamp_seconds gauge
dtrain_gate_timestamp_seconds{node=\"$node\"} $(date +%s)"
    { echo "$metrics" >"$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$TEXTFILE_DIR/dtrain_gate.prom"; } || rm -f "$tmp"
  fi
  [ -n "$reason" ] || return 0
  reason="gate:${reason#;} (job $job)"
  scontrol update nodename="$node" state=drain reason="$reason" && log "drained $node: $reason"
  # Slurm holds a requeued job back for two minutes, time for epilogs like this one. The job requeued
  # itself to leave this node out, which is drained now: the hold is lifted once the job is pending
  # again, which is after every node's epilog, this one's included. So the waiter outlives this script:
  # its own session (slurmd ends the epilog's process group), none of slurmd's descriptors, a minute at most.
  setsid bash -c "$LIFT_REQUEUE_HOLD" lift-requeue-hold "$job" </dev/null >/dev/null 2>&1 &
  return 0
}
# shellcheck disable=SC2016  # expanded by the waiter's own bash, where $1 is the job
readonly LIFT_REQUEUE_HOLD='for _ in $(seq 60); do
  case $(timeout -k 2 10 squeue -h -j "$1" -o %T) in
    PENDING) exec scontrol update jobid="$1" starttime=now ;;
    RUNNING | COMPLETING | CONFIGURING | REQUEUED) sleep 1 ;;
    *) exit 0 ;;
  esac
done'
drain_after_gate

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
