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
# udev links every assembled array here by UUID, whatever /dev/mdN name it got at boot; mdadm
# makes MD_DEVICE itself for the arrays it creates or assembles.
readonly MD_UUID_LINK_PREFIX=/dev/disk/by-id/md-uuid-
readonly MDADM_CONF=/etc/mdadm/mdadm.conf
readonly FSTAB=/etc/fstab
readonly EXPORTS_FILE=/etc/exports.d/training.exports

log() { echo "nfs-data-setup: $*" >&2; }

# include md-volume.sh

# The array's name in mdadm.conf, baked into the initramfs: it keeps its name across reboots.
record_array() {
  local uuid
  uuid=$(member_array_uuid "${DATA_DISKS[0]}")
  if ! grep -qs "UUID=$uuid" "$MDADM_CONF"; then
    mdadm --detail --brief "$DEVICE" >>"$MDADM_CONF"
    update-initramfs -u
  fi
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

wait_for_disks "${DATA_DISKS[@]}"
select_device "${DATA_DISKS[@]}"
if ((${#DATA_DISKS[@]} > 1)); then
  record_array
fi
make_filesystem
mount_by_uuid "$EXPORT_PATH" "$FSTAB"
export_data
log "exported $EXPORT_PATH"
