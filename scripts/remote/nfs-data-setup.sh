#!/bin/bash
# Builds the NFS server's data volume (RAID 0 over the Azure data disks, XFS), mounts it and
# exports it. Safe to re-run: an existing array is reassembled, never re-created, and an existing
# file system is kept.
set -euo pipefail

DATA_DISKS=@DATA_DISKS@
EXPORT_PATH=@EXPORT_PATH@
EXPORT_LINE=@EXPORT_LINE@
readonly MD_NAME=nfsdata
readonly MD_DEVICE=/dev/md/nfsdata
# udev links every assembled array here by UUID, whatever /dev/mdN name it got at boot.
readonly MD_UUID_LINK_PREFIX=/dev/disk/by-id/md-uuid-
readonly MDADM_CONF=/etc/mdadm/mdadm.conf
readonly FSTAB=/etc/fstab
readonly EXPORTS_FILE=/etc/exports.d/training.exports
readonly DISK_WAIT_SECONDS=300

log() { echo "nfs-data-setup: $*" >&2; }

wait_for_disks() {
  local deadline=$((SECONDS + DISK_WAIT_SECONDS)) disk
  udevadm settle
  for disk in "${DATA_DISKS[@]}"; do
    until [ -e "$disk" ]; do
      if ((SECONDS >= deadline)); then
        log "data disk $disk did not appear within ${DISK_WAIT_SECONDS}s"
        exit 1
      fi
      sleep 5
    done
  done
}

# The md array UUID recorded on a member disk; empty for a blank disk.
member_array_uuid() {
  mdadm --examine --export "$1" 2>/dev/null | sed -n 's/^MD_UUID=//p' || true
}

# Sets DEVICE: the single data disk, or the RAID 0 array over all of them.
select_device() {
  if ((${#DATA_DISKS[@]} == 1)); then
    DEVICE=${DATA_DISKS[0]}
    return
  fi
  local uuid members
  uuid=$(member_array_uuid "${DATA_DISKS[0]}")
  if [ -z "$uuid" ]; then
    log "creating RAID 0 over ${DATA_DISKS[*]}"
    mdadm --create "$MD_DEVICE" --name="$MD_NAME" --level=0 \
      --raid-devices="${#DATA_DISKS[@]}" --run "${DATA_DISKS[@]}" >&2
    udevadm settle
    uuid=$(member_array_uuid "${DATA_DISKS[0]}")
  elif [ ! -e "$MD_UUID_LINK_PREFIX$uuid" ]; then
    log "assembling the existing array $uuid"
    mdadm --assemble "$MD_DEVICE" --uuid="$uuid" "${DATA_DISKS[@]}" >&2
    udevadm settle
  fi
  DEVICE=$MD_UUID_LINK_PREFIX$uuid
  members=$(mdadm --detail --export "$DEVICE" | sed -n 's/^MD_DEVICES=//p')
  if [ "$members" != "${#DATA_DISKS[@]}" ]; then
    log "array $uuid has $members members but ${#DATA_DISKS[@]} data disks are attached; refusing to guess"
    exit 1
  fi
  if ! grep -qs "UUID=$uuid" "$MDADM_CONF"; then
    # Recorded, and baked into the initramfs, so that the array keeps its name across reboots.
    mdadm --detail --brief "$DEVICE" >>"$MDADM_CONF"
    update-initramfs -u
  fi
}

make_filesystem() {
  local fs_type
  fs_type=$(blkid -o value -s TYPE "$DEVICE" || true)
  case "$fs_type" in
    xfs) log "keeping the existing XFS file system on $DEVICE" ;;
    "")
      log "formatting $DEVICE as XFS"
      # -K: new managed disks are already empty; discarding terabytes only delays boot.
      mkfs.xfs -K "$DEVICE" >&2
      ;;
    *)
      log "$DEVICE holds a $fs_type file system; refusing to format it"
      exit 1
      ;;
  esac
}

mount_data() {
  local fs_uuid
  fs_uuid=$(blkid -o value -s UUID "$DEVICE")
  mkdir -p "$EXPORT_PATH"
  if ! grep -qs "^UUID=$fs_uuid " "$FSTAB"; then
    # nofail: a lost disk must not drop the server into emergency mode, out of reach of SSH.
    printf 'UUID=%s %s xfs defaults,noatime,nofail 0 0\n' "$fs_uuid" "$EXPORT_PATH" >>"$FSTAB"
    systemctl daemon-reload
  fi
  mountpoint -q "$EXPORT_PATH" || mount "$EXPORT_PATH"
}

export_data() {
  # data/ is root's (blob-pull fills it). The rest is made by its users as the cluster's root: the
  # head node gives runs/ to the user who submits jobs, the nodes' health check makes .health/.
  mkdir -p "$EXPORT_PATH/data"
  # Written only now that the volume is mounted, so clients never see the bare mount point.
  mkdir -p "$(dirname "$EXPORTS_FILE")"
  printf '%s\n' "$EXPORT_LINE" >"$EXPORTS_FILE"
  systemctl daemon-reload
  systemctl enable --now nfs-server
  exportfs -ra
}

wait_for_disks
select_device
make_filesystem
mount_data
export_data
log "exported $EXPORT_PATH"
