#!/bin/bash
# First-boot setup of a GPU node, in order. It stops at the first failure, and cloud-init runs
# register-node only after it succeeded: a node is listed as ready only with its shared file
# system, NCCL settings and registry login in place. slurmd comes last, so that its first health
# check finds the same.
set -euo pipefail

systemctl daemon-reload
/usr/local/sbin/nfs-mount
systemctl enable --now nccl-conf.service
# The first login runs in the foreground; the timer then renews it before the token expires.
systemctl start acr-login.service
systemctl enable --now acr-login.timer
/usr/local/sbin/slurmd-setup
