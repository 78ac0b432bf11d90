#!/usr/bin/env bash
# `make test`: the operator suite and the training suite at the same time. Most of the operator suite
# waits on daemons (Slurm, sshd, Azurite, VMs) while the training suite computes, so together they
# take about the longer one's time instead of the sum (CI's limit is the reason). The operator suite
# prints as it goes; the training suite's output is kept in a log and printed whole when both are done,
# so each summary reads in one piece. Exits 1 if either failed, after both have finished.
set -uo pipefail
ops_python=$1 train_python=$2

# The second lane also takes the Pulumi program's tests (tests/infra, the operator's environment): the
# two lanes then take about as long as each other (measured: operator workflow 40 min against training
# 32 min when infra ran in the first lane).
log=$(mktemp -t training-suite.XXXXXX.log)
{
  "$train_python" -m pytest tests/training tests/bench
  training_status=$?
  "$ops_python" -m pytest tests/infra
  infra_status=$?
  exit $((training_status || infra_status))
} >"$log" 2>&1 &
second_lane=$!
trap 'kill "$second_lane" 2>/dev/null; rm -f "$log"' EXIT

"$ops_python" -m pytest tests/test_layout.py tests/scripts
ops_status=$?
wait "$second_lane"
second_status=$?

echo
echo "=============== training and infrastructure: tests/training tests/bench, then tests/infra ==============="
cat "$log"
echo
echo "operator workflow (tests/scripts): exit $ops_status; training and infrastructure: exit $second_status"
((ops_status == 0 && second_status == 0))
