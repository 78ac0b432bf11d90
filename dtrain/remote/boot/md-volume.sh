# Functions shared by the host scripts that build an XFS volume, on an md RAID 0 or a single disk
# (nfs-data-setup.sh, nvme-raid.sh, database-disk.sh). Not a program: render_script pastes it where a
# template says `# include md-volume.sh`, so that each installed script stays one self-contained file.
# The including script defines log(), MD_NAME, MD_DEVICE and MD_UUID_LINK_PREFIX.

# Waits until every disk given (Azure's data disks: /dev/disk/azure/scsi1/lunN) is there; exits 1 after
# 5 minutes without one of them.
wait_for_disks() {
  local deadline=$((SECONDS + 300)) disk
  udevadm settle
  for disk in "$@"; do
    until [ -e "$disk" ]; do
      if ((SECONDS >= deadline)); then
        log "data disk $disk did not appear within 300s"
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

# Sets DEVICE for the disks given: the disk itself when there is one, else the RAID 0 array over
# them: created on blank disks, else the one udev assembled at boot, else assembled here. Refuses
# an array whose member count is not the number of disks given.
select_device() {
  if (($# == 1)); then
    DEVICE=$1
    return
  fi
  local uuid members
  uuid=$(member_array_uuid "$1")
  if [ -z "$uuid" ]; then
    log "creating RAID 0 over $*"
    mdadm --create "$MD_DEVICE" --name="$MD_NAME" --level=0 --raid-devices=$# --run "$@" >&2
    DEVICE=$MD_DEVICE
  elif [ -e "$MD_UUID_LINK_PREFIX$uuid" ]; then
    DEVICE=$MD_UUID_LINK_PREFIX$uuid # assembled at boot by udev, under a name of its choosing
  elif [ -e "$MD_DEVICE" ]; then
    DEVICE=$MD_DEVICE # assembled by an earlier run
  else
    log "assembling the existing array $uuid"
    mdadm --assemble "$MD_DEVICE" --uuid="$uuid" "$@" >&2
    DEVICE=$MD_DEVICE
  fi
  udevadm settle
  members=$(mdadm --detail --export "$DEVICE" | sed -n 's/^MD_DEVICES=//p')
  if [ "$members" != "$#" ]; then
    log "array $DEVICE has ${members:-no} members but $# disks are attached; refusing to guess"
    exit 1
  fi
}

# Formats DEVICE as XFS when it is blank, keeps an XFS file system, refuses any other. XFS: its
# allocation groups let many readers and writers work in parallel across the whole stripe.
make_filesystem() {
  local fs_type
  fs_type=$(blkid -o value -s TYPE "$DEVICE" || true)
  case "$fs_type" in
    xfs) log "keeping the existing XFS file system on $DEVICE" ;;
    "")
      log "formatting $DEVICE as XFS"
      # -K: new managed disks and deallocated local disks are already empty; discarding
      # terabytes only delays the boot.
      mkfs.xfs -K "$DEVICE" >&2
      ;;
    *)
      log "$DEVICE holds a $fs_type file system; refusing to format it"
      exit 1
      ;;
  esac
}

# Mounts DEVICE's file system at $1, through a line by its UUID in the fstab $2, so that it comes back at
# every boot.
mount_by_uuid() {
  local fs_uuid
  fs_uuid=$(blkid -o value -s UUID "$DEVICE")
  mkdir -p "$1"
  if ! grep -qs "^UUID=$fs_uuid " "$2"; then
    # nofail: a lost disk must not drop the machine into emergency mode, out of reach of SSH.
    printf 'UUID=%s %s xfs defaults,noatime,nofail 0 0\n' "$fs_uuid" "$1" >>"$2"
    systemctl daemon-reload
  fi
  mountpoint -q "$1" || mount "$1"
}
