#!/bin/bash
# Azure's node health checks for this size (Azure/azurehpc-health-checks, on the ubuntu-hpc image):
# its entry point with the size's conf/<CONF>.conf, at every boot before slurmd starts
# (azure-health-checks.service). NHC stops at the first failed check and logs "Health check failed:
# <check>: <what it measured>. FaultCode: <code>". The verdict, one line in RESULT, is what
# slurm-health-check drains the node with: `ok`, `failed: <that check, or why the run did not end>`,
# `skipped: <why>` (no checks for the size: ours stand alone) or `running since <time>`.
# Exit status 1 when the checks failed (the unit shows failed), 0 otherwise.
set -uo pipefail

# infra/health_thresholds.py; empty: none
CONF=@AZURE_CHECKS_CONF@
# The run's bound (Azure's entry point bounds each check); slurmd waits for it within ResumeTimeout.
TIMEOUT_S=@AZURE_CHECKS_TIMEOUT_S@
RESULT=${AZURE_CHECKS_RESULT:-@AZURE_CHECKS_RESULT@}
AZURE_CHECKS_DIR=${AZURE_CHECKS_DIR:-/opt/azurehpc/test/azurehpc-health-checks}
LOG=${AZURE_CHECKS_LOG:-/var/log/azurehpc-health-checks.log} # Azure's log of the last run
readonly AZURE_CONTAINER=aznhc                                # what the entry point names its container

log() { echo "azure-health-checks: $*" >&2; }

# The verdict, replaced at once: the health check may read it any time.
record() {
  printf '%s\n' "$1" >"$RESULT.tmp" && mv -f "$RESULT.tmp" "$RESULT"
  log "$1"
}

failed_check() {
  sed -n 's/.*Health check failed:[[:space:]]*//p' "$LOG" "$work/output" 2>/dev/null | head -n 1 | tr -s ' \t' ' ' | grep .
}

work=$(dirname "$RESULT")
mkdir -p "$work" || exit 1
runner=$AZURE_CHECKS_DIR/run-health-checks.sh
conf=$AZURE_CHECKS_DIR/conf/$CONF.conf
if [[ -z $CONF ]]; then
  record "skipped: Azure has no checks for this size"
  exit 0
elif [[ ! -x $runner ]]; then
  record "skipped: no azurehpc-health-checks in $AZURE_CHECKS_DIR"
  exit 0
elif [[ ! -f $conf ]]; then
  record "skipped: this azurehpc-health-checks has no conf/$CONF.conf"
  exit 0
fi
record "running since $(date -u +%Y-%m-%dT%H:%M:%SZ)"

# The NCCL all-reduce check without a topology file, as Azure's fix for ND H100/H200 v5 runs it
# (azurehpc-health-checks issue 142, PR 143: with ndv5-topo.xml healthy nodes fell short). Copies
# older than the fix pass the conf's 4th argument on as NCCL_TOPO_FILE: the copy run here has none.
awk '$3 == "check_nccl_allreduce" && NF > 6 { $0 = $1 " " $2 " " $3 " " $4 " " $5 " " $6 } { print }' \
  "$conf" >"$work/$CONF.conf" || exit 1
rm -f "$LOG"
# Nor does the node's own NCCL_TOPO_FILE (the jobs': /etc/nccl.conf, the login profile) reach them.
timeout -k 30 "$TIMEOUT_S" env -u NCCL_TOPO_FILE "$runner" -c "$work/$CONF.conf" -o "$LOG" >"$work/output" 2>&1
status=$?
if ((status == 0)); then
  record ok
  exit 0
fi
if ((status == 124 || status == 137)); then
  docker rm -f "$AZURE_CONTAINER" >/dev/null 2>&1 # the entry point's `docker run` went, not its container
  why="azurehpc-health-checks did not finish within ${TIMEOUT_S}s"
elif ! why=$(failed_check); then
  why="azurehpc-health-checks exited with $status: $(tail -n 1 "$work/output")"
fi
record "failed: $why"
exit 1
