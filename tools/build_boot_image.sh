#!/usr/bin/env bash
# The boot test's VM image (tests/boot): a Debian bookworm root file system, made by mmdebstrap from
# tools/boot_image/packages, with the stand-ins for Azure's hardware in tools/boot_image/rootfs laid
# over it, as a raw ext4 disk with its kernel and initrd beside it. Prints the image's directory.
# Two caches under ~/.cache/boot-vm, like the Horovod wheel: the root file system as a tarball keyed
# by the package list (the slow part: minutes, once), and the disk keyed by that and the overlay
# (seconds). Needs root (mmdebstrap's root mode) and Debian's archive for the first build.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# What only the boot test uses, so not in tools/setup_system.sh (CI does not run the boot test yet):
# the image (mmdebstrap), the VMs' overlay disks (qemu-img), their NoCloud seeds (genisoimage), their
# local package repository (dpkg-scanpackages).
missing=()
for tool in mmdebstrap:mmdebstrap qemu-img:qemu-utils genisoimage:genisoimage dpkg-scanpackages:dpkg-dev; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing the boot test's tools: ${missing[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
source_dir=$here/boot_image
cache=${XDG_CACHE_HOME:-$HOME/.cache}/boot-vm
base_key=$(grep -v "^#" "$source_dir/packages" | sha256sum | cut -c1-16)  # comments aside
base=$cache/rootfs-$base_key.tar
key=$( (echo "$base_key" && cat "$0" && cd "$source_dir" && find rootfs -type f | sort | xargs sha256sum) | sha256sum | cut -c1-16)
target=$cache/image-$key
if [ -f "$target/.complete" ]; then
  echo "$target"
  exit 0
fi
mkdir -p "$cache"
work=$(mktemp -d "$cache/work.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS

if [ ! -f "$base" ]; then
  echo "building the boot test's root file system into $base (minutes, once)" >&2
  mmdebstrap --variant=apt --include="$(grep -v '^#' "$source_dir/packages" | paste -sd, -)" \
    bookworm "$work/base.tar" http://deb.debian.org/debian >&2
  mv "$work/base.tar" "$base"
  echo "root file system: $((SECONDS - start)) s, $(du -m "$base" | cut -f1) MiB" >&2
fi

mkdir "$work/root"
tar -xf "$base" -C "$work/root"
cp -a "$source_dir/rootfs/." "$work/root/"
echo "/dev/vda / ext4 defaults,errors=remount-ro 0 1" >"$work/root/etc/fstab"
systemctl --root="$work/root" enable boot-hardware.service >/dev/null 2>&1
# apt's periodic jobs would hold its lock while cloud-init installs packages.
systemctl --root="$work/root" mask apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1
cp -L "$work/root/vmlinuz" "$work/vmlinuz"
cp -L "$work/root/initrd.img" "$work/initrd.img"
# The disk: sparse, as large as the nodes' health check wants free space (50 GB, infra/contract.py),
# with few inodes so that its tables stay small (the VMs' cloud-init could not grow a small one).
mke2fs -q -t ext4 -N 262144 -E lazy_itable_init=1,lazy_journal_init=1 -d "$work/root" -L root "$work/rootfs.img" 64G
rm -rf "$work/root"
rm -rf "$target"
mv "$work" "$target"
trap - EXIT
touch "$target/.complete"
echo "image: $((SECONDS - start)) s in all, disk $(du -sm "$target/rootfs.img" | cut -f1) MiB used" >&2
# Keep only the current ones: each is most of a gigabyte.
find "$cache" -mindepth 1 -maxdepth 1 ! -name "image-$key" ! -name "rootfs-$base_key.tar" -exec rm -rf {} +
echo "$target"
