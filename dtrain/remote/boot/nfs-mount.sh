#!/bin/bash
# Mounts the cluster's NFS share, waiting (bounded) for the server, which may still be building
# its array when the nodes boot. Safe to re-run.
set -euo pipefail

SOURCE=@SOURCE@
MOUNT_PATH=@MOUNT_PATH@
readonly FS_TYPE=nfs
# hard: I/O waits out a server restart instead of failing a training job; _netdev and nofail keep
# a missing server from blocking boot. x-systemd.before: when a powered-down node boots again,
# slurmd starts once the mount was tried, so its first health check does not find /shared missing.
readonly MOUNT_OPTIONS=_netdev,nofail,hard,noatime,x-systemd.before=slurmd.service

log() { echo "nfs-mount: $*" >&2; }

# include mount-wait.sh

mount_shared
