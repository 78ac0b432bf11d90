#!/bin/bash
# Builds a GPU node's scratch volume on its local NVMe disks: RAID 0 over them (a single disk is
# used as it is), XFS, mounted at MOUNT_PATH. Runs at every boot, before slurmd: Azure hands the
# disks back empty after each deallocation, so the volume is built again then; on any other boot,
# or when run again, an existing array and file system are kept. Nothing goes into fstab or
# mdadm.conf: a rebuilt volume has new UUIDs, and a stale entry would only stall the next boot.
# Usage: nvme-raid [DEVICE...]  (no DEVICE: every local NVMe disk of the VM, found by its model)
set -euo pipefail

MOUNT_PATH=@MOUNT_PATH@
# The VM size's local NVMe disk count; 0 where Azure does not state it (any number is taken).
EXPECTED_DISKS=@EXPECTED_DISKS@
# Azure's model for local (temp) NVMe disks; managed disks attached over NVMe report another.
readonly LOCAL_NVME_MODEL='^Microsoft NVMe Direct Disk( v2)?$'
readonly MD_NAME=nvme
readonly MD_DEVICE=/dev/md/nvme
# udev links every assembled array here by UUID, whatever /dev/mdN name it got at boot; mdadm
# makes MD_DEVICE itself for the arrays it creates or assembles.
readonly MD_UUID_LINK_PREFIX=/dev/disk/by-id/md-uuid-
readonly DISK_WAIT_SECONDS=300

log() { echo "nvme-raid: $*" >&2; }

local_nvme_disks() {
  lsblk --nodeps --noheadings --paths --output NAME,MODEL |
    awk -v model="$LOCAL_NVME_MODEL" '{ name = $1; sub(/^[^ ]+ */, ""); sub(/ +$/, ""); if ($0 ~ model) print name }'
}

# Sets DISKS: the arguments, or the local NVMe disks once the size's count of them has appeared.
find_disks() {
  if (($# > 0)); then
    DISKS=("$@")
    return
  fi
  local deadline=$((SECONDS + DISK_WAIT_SECONDS))
  while true; do
    udevadm settle
    mapfile -t DISKS < <(local_nvme_disks)
    if ((${#DISKS[@]} > 0 && (EXPECTED_DISKS == 0 || ${#DISKS[@]} == EXPECTED_DISKS))); then
      return
    fi
    if ((SECONDS >= deadline)); then
      log "found ${#DISKS[@]} local NVMe disks (${DISKS[*]}), expected $EXPECTED_DISKS (0: one or more)"
      exit 1
    fi
    sleep 5
  done
}

# include md-volume.sh

mount_volume() {
  mkdir -p "$MOUNT_PATH"
  mount -o noatime "$DEVICE" "$MOUNT_PATH"
  # Scratch for every job's user, as /tmp is: each may create, none may remove another's files.
  chmod 1777 "$MOUNT_PATH"
}

if mountpoint -q "$MOUNT_PATH"; then
  log "$MOUNT_PATH is already mounted"
  exit 0
fi
find_disks "$@"
select_device "${DISKS[@]}"
make_filesystem
mount_volume
log "mounted $DEVICE at $MOUNT_PATH"
