#!/usr/bin/env bash
# `make test`: the operator suite and the training suite at the same time. Most of the operator suite
# waits on daemons (Slurm, sshd, Azurite, VMs) while the training suite computes, so together they
# take about the longer one's time instead of the sum (CI's limit is the reason). The operator suite
# prints as it goes; the training suite's output is kept in a log and printed whole when both are done,
# so each summary reads in one piece; so is the boot test's (below). Exits 1 if any failed, after all
# have finished.
#
# The operator suite (tests/test_layout.py, tests/scripts, tests/infra) is one pytest session spread
# over $OPS_WORKERS worker processes by pytest-xdist, a whole file to a worker at a time (--dist
# loadfile: a file's tests keep their order and its module fixtures): its files mostly wait, so two of
# them at once take about the time of one. Each worker is a session of its own, with its own local
# cluster (tests/scripts/conftest.py names clusters by process and claims each subnet). Two: on three
# the lane takes 26 minutes instead of 44, but twice the slow-rank test (tests/scripts/test_slow_ranks.py)
# did not see its slowed rank named within 180 s, every process being starved. A test that mounts a real filesystem
# does it in a mount namespace of its own (tests/infra/test_nvme_raid.py): another worker's local
# cluster makes namespaces that would keep a copy of a host mount busy. The slowest tests of each suite
# are listed above its summary, to rebalance by. OPS_WORKERS=1: the old single lane.
#
# The training suite runs on $TRAIN_WORKERS workers the same way (a file to a worker). Its tests compute,
# but many of them also wait: on torchrun to stop a job, on a hang's timeout, on a killed rank's peer.
# On one worker it was the longest lane (49 of CI's 53 minutes, beside the others); two fill each
# other's waits and give the computing lane its share of the CPUs.
set -uo pipefail
ops_python=$1 train_python=$2
ops_workers=${OPS_WORKERS:-2}
train_workers=${TRAIN_WORKERS:-2}

log=$(mktemp -t training-suite.XXXXXX.log)
boot_log=$(mktemp -t boot-test.XXXXXX.log)
"$train_python" -m pytest --durations=15 -n "$train_workers" --dist loadfile tests/training tests/bench >"$log" 2>&1 &
second_lane=$!
# The boot test (tests/boot/test_boot.py): the Azure custom data booted in system containers. It
# mostly waits on the containers' boots, so it runs beside the others too; its image and Slurm's
# packages are built first (cached after the first run).
{ tools/build_boot_image.sh container >/dev/null &&
  DTRAIN_BOOT_TEST=1 "$ops_python" -m pytest -s -p no:cacheprovider tests/boot/test_boot.py; } >"$boot_log" 2>&1 &
boot_lane=$!
trap 'kill "$second_lane" "$boot_lane" 2>/dev/null; rm -f "$log" "$boot_log"' EXIT

"$ops_python" -m pytest --durations=15 -n "$ops_workers" --dist loadfile tests/test_layout.py tests/scripts tests/infra
ops_status=$?
wait "$boot_lane"
boot_status=$?
wait "$second_lane"
second_status=$?

echo
echo "=============== boot: tests/boot/test_boot.py ==============="
cat "$boot_log"
echo
echo "=============== training: tests/training tests/bench ==============="
cat "$log"
echo
echo "operator workflow and infrastructure (tests/test_layout.py tests/scripts tests/infra, $ops_workers workers): exit $ops_status; boot: exit $boot_status; training ($train_workers workers): exit $second_status"
((ops_status == 0 && boot_status == 0 && second_status == 0))
