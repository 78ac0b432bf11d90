#!/usr/bin/env bash
# `make test`: the operator suite and the training suite at the same time. Most of the operator suite
# waits on daemons (Slurm, sshd, Azurite, VMs) while the training suite computes, so together they
# take about the longer one's time instead of the sum (CI's limit is the reason). The operator suite
# prints as it goes; the training suite's output is kept in a log and printed whole when both are done,
# so each summary reads in one piece. Exits 1 if either failed, after both have finished.
set -uo pipefail
ops_python=$1 train_python=$2

log=$(mktemp -t training-suite.XXXXXX.log)
"$train_python" -m pytest tests/training tests/bench >"$log" 2>&1 &
training=$!
trap 'kill "$training" 2>/dev/null; rm -f "$log"' EXIT

"$ops_python" -m pytest tests/test_layout.py tests/infra tests/scripts
ops_status=$?
wait "$training"
training_status=$?

echo
echo "=============== training suite: tests/training tests/bench ==============="
cat "$log"
echo
echo "operator suite: exit $ops_status; training suite: exit $training_status"
((ops_status == 0 && training_status == 0))
