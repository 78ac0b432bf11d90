#!/bin/bash
# Slurm's HealthCheckProgram: the node checks the launcher's preflight makes (GPUs, an ACTIVE
# InfiniBand port, the shared file system, free disk). A node that fails is drained with the failed
# checks as the reason; a node that this script drained is resumed once every check passes again.
# A node drained for any other reason is left alone.
#
# slurmd runs it as root every HealthCheckInterval, and once before it registers, with only
# SLURMD_NODENAME in the environment, and kills it after 60 s. Every setting below may be given in
# the environment instead, so that another cluster (the local one) runs this same script.
set -uo pipefail # not -e: every check runs, and all failures are reported together

SHARED_MOUNT=${SHARED_MOUNT:-@SHARED_MOUNT@}
SHARED_IS_MOUNT=${SHARED_IS_MOUNT:-1} # 0: a shared directory, not a mount (the local cluster)
EXPECTED_GPUS=${EXPECTED_GPUS:-@EXPECTED_GPUS@} # 0: no GPU check (CPU nodes)
CHECK_INFINIBAND=${CHECK_INFINIBAND:-@CHECK_INFINIBAND@} # 0: no InfiniBand check
MIN_FREE_GB=${MIN_FREE_GB:-@MIN_FREE_GB@}
FREE_DISK_PATH=${FREE_DISK_PATH:-@FREE_DISK_PATH@} # falls back to / where it does not exist
IB_SYSFS=${IB_SYSFS:-/sys/class/infiniband}
NODE=${SLURMD_NODENAME:-$(hostname -s)}
readonly REASON_PREFIX="health-check:"
# A dead NFS server hangs stat on a hard mount: give up on a probe well within slurmd's 60 s.
readonly PROBE_SECONDS=15

failures=()

check_gpus() {
  ((EXPECTED_GPUS > 0)) || return 0
  local found
  found=$(timeout -k 2 "$PROBE_SECONDS" nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  ((found >= EXPECTED_GPUS)) || failures+=("$found of $EXPECTED_GPUS GPUs")
}

check_infiniband() {
  ((CHECK_INFINIBAND)) || return 0
  local port seen=absent
  shopt -s nullglob
  for port in "$IB_SYSFS"/*/ports/*; do
    # The accelerated-networking NIC is listed here too, ACTIVE on an Ethernet link layer.
    [ "$(cat "$port/link_layer" 2>/dev/null)" = InfiniBand ] || continue
    seen=DOWN
    grep -q ACTIVE "$port/state" && return 0
  done
  failures+=("no ACTIVE InfiniBand port (InfiniBand $seen)")
}

check_shared() {
  if ((SHARED_IS_MOUNT)); then
    timeout -k 2 "$PROBE_SECONDS" mountpoint -q "$SHARED_MOUNT" || failures+=("$SHARED_MOUNT not mounted")
  elif [ ! -d "$SHARED_MOUNT" ] || [ ! -w "$SHARED_MOUNT" ]; then
    failures+=("$SHARED_MOUNT missing or not writable")
  fi
}

check_disk() {
  local path=$FREE_DISK_PATH free_kb
  [ -e "$path" ] || path=/
  free_kb=$(df -Pk "$path" | awk 'NR == 2 { print $4 }')
  ((${free_kb:-0} >= MIN_FREE_GB * 1024 * 1024)) ||
    failures+=("$((${free_kb:-0} / 1024 / 1024)) GB free on $path, need $MIN_FREE_GB")
}

check_gpus
check_infiniband
check_shared
check_disk

node=$(scontrol show node "$NODE" --oneliner) || {
  echo "slurm-health-check: cannot read the state of node $NODE" >&2
  exit 1
}
state=$(grep -o ' State=[^ ]*' <<<"$node")
drained_by_us=0
[[ $state == *DRAIN* && $node == *" Reason=$REASON_PREFIX"* ]] && drained_by_us=1

if ((${#failures[@]})); then
  reason=$REASON_PREFIX
  for failure in "${failures[@]}"; do reason+=" $failure;"; done
  reason=${reason%;}
  echo "slurm-health-check: $reason" >&2
  # Never take over a node someone else drained, nor rewrite an unchanged reason.
  if [[ $state != *DRAIN* ]] || { ((drained_by_us)) && [[ $node != *" Reason=$reason ["* ]]; }; then
    scontrol update nodename="$NODE" state=drain reason="$reason"
  fi
  exit 1
fi
if ((drained_by_us)); then
  scontrol update nodename="$NODE" state=resume
fi
