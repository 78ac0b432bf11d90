#!/bin/bash
# Slurm's HealthCheckProgram: the node checks (GPUs, InfiniBand ports ACTIVE at their rate, the verdict
# of Azure's checks at this boot, the shared file system, free disk). A node that fails is drained
# with the failed checks, and what they found, as the reason; a node that this script drained is
# resumed once every check passes again. A node drained for any other reason is left alone. Each run also leaves its result in
# $HEALTH_REPORT_DIR/<node> (key=value lines: node, checked_at, ok, one per check, reason), which
# the operator's `status` command shows.
#
# slurmd runs it as root every HealthCheckInterval, and once before it registers, with only
# SLURMD_NODENAME in the environment, and kills it after 60 s. So only quick checks, which read sysfs,
# nvidia-smi's device list and a file in well under a second beside running jobs: Azure's bandwidth
# tests take minutes and the GPUs and links to themselves. They run at boot, before slurmd
# (azure-health-checks.sh); this reports their verdict until the next boot. Thresholds: the size's,
# from infra/health_thresholds.py. Every setting below may be given in the environment instead, so
# that another cluster (the local one) runs this same script.
set -uo pipefail # not -e: every check runs, and all failures are reported together

SHARED_MOUNT=${SHARED_MOUNT:-@SHARED_MOUNT@}
SHARED_IS_MOUNT=${SHARED_IS_MOUNT:-1} # 0: a shared directory, not a mount (the local cluster)
EXPECTED_GPUS=${EXPECTED_GPUS:-@EXPECTED_GPUS@} # 0: no GPU check (CPU nodes)
# InfiniBand ports that must be ACTIVE (0: no check), each at this rate at least (0: any), as Azure's check_hw_ib
INFINIBAND_PORTS=${INFINIBAND_PORTS:-@INFINIBAND_PORTS@}
INFINIBAND_RATE_GBPS=${INFINIBAND_RATE_GBPS:-@INFINIBAND_RATE_GBPS@}
# The size's conf in Azure's checks (empty, here or in the environment: none), and their verdict at this boot
AZURE_CHECKS_CONF=${AZURE_CHECKS_CONF-@AZURE_CHECKS_CONF@}
AZURE_CHECKS_RESULT=${AZURE_CHECKS_RESULT:-@AZURE_CHECKS_RESULT@}
MIN_FREE_GB=${MIN_FREE_GB:-@MIN_FREE_GB@}
FREE_DISK_PATH=${FREE_DISK_PATH:-@FREE_DISK_PATH@} # falls back to / where it does not exist
IB_SYSFS=${IB_SYSFS:-/sys/class/infiniband}
# node-setup's results at this boot (boot-steps.sh): why the shared file system's mount step failed
BOOT_STEPS_DIR=${BOOT_STEPS_DIR:-/run/node-setup}
HEALTH_REPORT_DIR=${HEALTH_REPORT_DIR:-$SHARED_MOUNT/@HEALTH_REPORT_NAME@} # the last result, one file per node
NODE=${SLURMD_NODENAME:-$(hostname -s)}
readonly REASON_PREFIX="health-check:"
# A dead NFS server hangs stat on a hard mount: give up on a probe well within slurmd's 60 s.
readonly PROBE_SECONDS=15

# Each check prints its result, "ok", "not checked" or what is wrong, and fails in the last case.
check_gpus() {
  ((EXPECTED_GPUS > 0)) || { echo "not checked" && return 0; }
  local found
  found=$(timeout -k 2 "$PROBE_SECONDS" nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  ((found >= EXPECTED_GPUS)) && echo ok && return 0
  echo "$found of $EXPECTED_GPUS GPUs" && return 1
}

check_infiniband() {
  ((INFINIBAND_PORTS > 0)) || { echo "not checked" && return 0; }
  local port name state rate up=0 short=() at=""
  ((INFINIBAND_RATE_GBPS > 0)) && at=" at $INFINIBAND_RATE_GBPS Gb/s"
  shopt -s nullglob
  for port in "$IB_SYSFS"/*/ports/*; do
    # The accelerated-networking NIC is listed here too, ACTIVE on an Ethernet link layer.
    [ "$(cat "$port/link_layer" 2>/dev/null)" = InfiniBand ] || continue
    name=${port#"$IB_SYSFS"/}
    name=${name/\/ports\//:} # mlx5_ib3:1, as Azure's checks name a port
    state=$(cat "$port/state" 2>/dev/null) # "4: ACTIVE"
    state=${state#*: }
    rate=$(cat "$port/rate" 2>/dev/null) # "400 Gb/sec (4X NDR)"
    rate=${rate%%[!0-9]*}
    if [[ $state != ACTIVE ]]; then
      short+=("$name ${state:-without a state}")
    elif ((${rate:-0} < INFINIBAND_RATE_GBPS)); then
      short+=("$name at ${rate:-an unknown rate}${rate:+ Gb/s}")
    else
      up=$((up + 1))
    fi
  done
  ((up >= INFINIBAND_PORTS)) && echo ok && return 0
  local found="none found"
  ((${#short[@]})) && found=$(printf '%s, ' "${short[@]}") && found=${found%, }
  echo "$up of $INFINIBAND_PORTS InfiniBand ports ACTIVE$at ($found)" && return 1
}

# Azure's checks at this boot passed (ok), or have none for the size (skipped); not run or running: not yet.
check_azure_checks() {
  [ -n "$AZURE_CHECKS_CONF" ] || { echo "not checked" && return 0; }
  local result
  result=$(head -n 1 "$AZURE_CHECKS_RESULT" 2>/dev/null) || result=""
  case $result in
    ok | skipped:*) echo "$result" && return 0 ;;
    failed:*) echo "azurehpc-health-checks: ${result#failed: }" ;;
    "") echo "azurehpc-health-checks not run at this boot" ;;
    *) echo "azurehpc-health-checks $result" ;;
  esac
  return 1
}

# The failed mount step's result at this boot (nfs-mount, lustre-mount: "failed: <its last words>"), if any.
mount_failure() {
  local result
  for result in "$BOOT_STEPS_DIR"/*-mount; do
    [[ -f $result && $(<"$result") == failed:* ]] && cat "$result" && return 0
  done
  return 1
}

check_shared() {
  local why
  if ((SHARED_IS_MOUNT)); then
    timeout -k 2 "$PROBE_SECONDS" mountpoint -q "$SHARED_MOUNT" && echo ok && return 0
    why=$(mount_failure) && echo "$SHARED_MOUNT not mounted ($why)" && return 1
    echo "$SHARED_MOUNT not mounted" && return 1
  fi
  [ -d "$SHARED_MOUNT" ] && [ -w "$SHARED_MOUNT" ] && echo ok && return 0
  echo "$SHARED_MOUNT missing or not writable" && return 1
}

check_disk() {
  local path=$FREE_DISK_PATH free_kb
  [ -e "$path" ] || path=/
  free_kb=$(df -Pk "$path" | awk 'NR == 2 { print $4 }')
  ((${free_kb:-0} >= MIN_FREE_GB * 1024 * 1024)) && echo ok && return 0
  echo "$((${free_kb:-0} / 1024 / 1024)) GB free on $path, need $MIN_FREE_GB" && return 1
}

results=()  # report lines, name=result
failures=() # what is wrong, for the drain reason
run_check() {
  local result status
  result=$("check_$1")
  status=$?
  results+=("$1=${result//$'\n'/ }")
  ((status == 0)) || failures+=("$result")
  return "$status"
}
shared_ok=0
run_check gpus
run_check infiniband
run_check azure_checks
run_check shared && shared_ok=1
run_check disk
reason=""
if ((${#failures[@]})); then
  reason=$REASON_PREFIX
  for failure in "${failures[@]}"; do reason+=" $failure;"; done
  reason=${reason%;}
fi

# The report, written atomically (a temporary file in the same directory, then a rename): readers
# never see half of one. Not in a directory on the shared file system unless that passed its check:
# a dead NFS server would hang the write, and under an empty mount point it would land on the
# local disk, where nobody looks.
write_report() {
  local dir=$HEALTH_REPORT_DIR tmp
  if [[ $dir == "$SHARED_MOUNT" || $dir == "$SHARED_MOUNT"/* ]] && ((!shared_ok)); then
    return 0
  fi
  [ -d "$dir" ] || install -d -m 0755 "$dir" || return 1
  tmp=$(mktemp "$dir/.$NODE.XXXXXX") || return 1
  if ! {
    printf '%s\n' "node=$NODE" "checked_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "ok=$((${#failures[@]} == 0))" \
      "${results[@]}" "reason=$reason" >"$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$dir/$NODE"
  }; then
    rm -f "$tmp"
    return 1
  fi
}
# Only a record for the operator's `status`: never a reason to fail the check.
write_report || echo "slurm-health-check: could not write the report in $HEALTH_REPORT_DIR" >&2

node=$(scontrol show node "$NODE" --oneliner) || {
  echo "slurm-health-check: cannot read the state of node $NODE" >&2
  exit 1
}
state=$(grep -o ' State=[^ ]*' <<<"$node")
drained_by_us=0
# A drain without a reason is ours too: a node that registers while Slurm holds it powered down (a
# first boot, started by Azure) keeps the drain of this script's run before registration, not its reason.
[[ $state == *DRAIN* && ($node == *" Reason=$REASON_PREFIX"* || $node != *" Reason="*) ]] && drained_by_us=1

if [ -n "$reason" ]; then
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
