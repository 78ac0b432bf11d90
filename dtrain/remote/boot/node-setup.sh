#!/bin/bash
# First-boot setup of a GPU node, in order, stopping at the first failure. slurmd comes last, so
# that a node joins Slurm only with its shared file system, NCCL settings and registry login in
# place, and its first health check finds them.
set -euo pipefail

systemctl daemon-reload
/usr/local/sbin/nfs-mount
systemctl enable --now nccl-conf.service
# Enabled for every later boot too: a deallocated node starts again with empty NVMe disks.
systemctl enable --now nvme-raid.service
# The first login runs in the foreground; the timer then renews it before the token expires.
systemctl start acr-login.service
systemctl enable --now acr-login.timer
/usr/local/sbin/slurmd-setup
# Turns a Spot eviction notice (Scheduled Events) into a checkpoint and a requeue; idle on on-demand nodes.
systemctl enable --now spot-agent.service
