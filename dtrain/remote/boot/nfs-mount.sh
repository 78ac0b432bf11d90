#!/bin/bash
# Mounts the cluster's NFS share, waiting (bounded) for the server, which may still be building
# its array when the nodes boot. Safe to re-run.
set -euo pipefail

NFS_SOURCE=@NFS_SOURCE@
MOUNT_PATH=@MOUNT_PATH@
readonly FSTAB=/etc/fstab
# hard: I/O waits out a server restart instead of failing a training job; _netdev and nofail keep
# a missing server from blocking boot. x-systemd.before: when a powered-down node boots again,
# slurmd starts once the mount was tried, so its first health check does not find /shared missing.
readonly MOUNT_OPTIONS=_netdev,nofail,hard,noatime,x-systemd.before=slurmd.service
readonly WAIT_SECONDS=1200
readonly ATTEMPT_SECONDS=60
readonly RETRY_SECONDS=10

log() { echo "nfs-mount: $*" >&2; }

mkdir -p "$MOUNT_PATH"
if ! awk -v path="$MOUNT_PATH" '$2 == path { found = 1 } END { exit !found }' "$FSTAB"; then
  printf '%s %s nfs %s 0 0\n' "$NFS_SOURCE" "$MOUNT_PATH" "$MOUNT_OPTIONS" >>"$FSTAB"
  systemctl daemon-reload
fi

deadline=$((SECONDS + WAIT_SECONDS))
until mountpoint -q "$MOUNT_PATH"; do
  if ((SECONDS >= deadline)); then
    log "$NFS_SOURCE did not answer within ${WAIT_SECONDS}s"
    exit 1
  fi
  if ! timeout "$ATTEMPT_SECONDS" mount "$MOUNT_PATH"; then
    log "$NFS_SOURCE not mountable yet; retrying in ${RETRY_SECONDS}s"
    sleep "$RETRY_SECONDS"
  fi
done
log "mounted $NFS_SOURCE at $MOUNT_PATH"
