#!/usr/bin/env bash
# A Debian kernel for the virtual machine in which tests/infra/test_nvme_raid.py builds RAID 0 over
# emulated NVMe disks: containers have no md driver of their own. Downloads Debian's current
# linux-image-amd64 once into ~/.cache/nvme-vm/<version> (the package is unpacked, not installed)
# and indexes its modules; a second run costs nothing.
set -euo pipefail

cache=${XDG_CACHE_HOME:-$HOME/.cache}/nvme-vm
current_package() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}
package=$(current_package)
if [ -z "$package" ] && [ "$(id -u)" -eq 0 ]; then
  apt-get update -qq
  package=$(current_package)
fi
if [ -z "$package" ]; then
  echo "fetch_vm_kernel: apt knows no linux-image-amd64; run apt-get update (as root)" >&2
  exit 1
fi
version=${package#linux-image-}
target=$cache/$version
[ -f "$target/.complete" ] && exit 0

echo "fetching $package for the NVMe RAID test VM"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# As root, apt warns that it downloads unsandboxed; show its output only when it fails.
if ! (cd "$work" && apt-get download -qq "$package" >"$work/apt.log" 2>&1); then
  cat "$work/apt.log" >&2
  exit 1
fi
rm -rf "$target"
mkdir -p "$target"
dpkg-deb --extract "$work"/"$package"_*.deb "$target"
depmod --basedir "$target" "$version"
touch "$target/.complete"
# Debian replaces the kernel with each point release: keep only the current one.
find "$cache" -mindepth 1 -maxdepth 1 ! -name "$version" -exec rm -rf {} +
