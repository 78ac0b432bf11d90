#!/bin/bash
# Mounts the cluster's Azure Managed Lustre file system with the image's Lustre client (the ubuntu-hpc
# images carry amlfs-lustre-client, built for and held at their kernel), waiting (bounded) for the file
# system. Safe to re-run. Before the machine goes, shared-release unmounts it (Azure's guidance: a
# client unmounts before it shuts down).
set -euo pipefail

SOURCE=@SOURCE@
MOUNT_PATH=@MOUNT_PATH@
readonly FS_TYPE=lustre
# noatime and flock: Azure's recommended options (flock: the locks that training tools take on shared
# files work across nodes). _netdev, nofail and x-systemd.before: as for NFS (nfs-mount.sh).
readonly MOUNT_OPTIONS=noatime,flock,_netdev,nofail,x-systemd.before=slurmd.service

log() { echo "lustre-mount: $*" >&2; }

# include mount-wait.sh

if ! command -v mount.lustre >/dev/null; then
  log "no Lustre client on this image (mount.lustre not found): use an ubuntu-hpc image, which carries one"
  exit 1
fi
mount_shared
