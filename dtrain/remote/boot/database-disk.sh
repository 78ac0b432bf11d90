#!/bin/bash
# Mounts the head node's own data disk at MariaDB's data directory (XFS, by UUID in fstab), before
# MariaDB's package is installed: it makes its data directory as it installs, and it must make it there.
# The disk is a managed disk of its own that outlives the VM (infra/head.py): a new head node finds the
# accounting database it left, and keeps it (an existing file system is never formatted again). Run by
# head-setup's database-disk step; safe to re-run. Exit status 0 when mounted.
set -euo pipefail

DATA_DISK=@DATA_DISK@
MOUNT_PATH=@MOUNT_PATH@
# md-volume.sh's array names: one disk is used as it is, without an array
readonly MD_NAME=slurmdb MD_DEVICE=/dev/md/slurmdb MD_UUID_LINK_PREFIX=/dev/disk/by-id/md-uuid-
readonly FSTAB=/etc/fstab

log() { echo "database-disk: $*" >&2; }

# include md-volume.sh

if mountpoint -q "$MOUNT_PATH"; then
  log "$MOUNT_PATH is mounted"
  exit 0
fi
wait_for_disks "$DATA_DISK"
select_device "$DATA_DISK"
make_filesystem
mount_by_uuid "$MOUNT_PATH" "$FSTAB"
log "mounted $DEVICE at $MOUNT_PATH"
