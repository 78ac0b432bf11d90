#!/usr/bin/env bash
# The boot test's machine image (tests/boot), standing in for Azure's ubuntu-hpc and Ubuntu images:
# a Debian bookworm root file system made by mmdebstrap from tools/boot_image/packages, with the
# stand-ins for Azure's hardware and the image's tools (tools/boot_image/rootfs: nvidia-smi, Azure's
# node health checks) and the ubuntu-hpc image's apt pins laid
# over it. Beside it, the packages the custom data installs, as the hosts' apt reaches them on Azure:
#   slurm/    Microsoft's Slurm repository's packages (tools/build_slurm_packages.sh)
#   archive/  the distribution's packages that the custom data names (tools/boot_image/archive-packages),
#             with whatever of their dependencies the image lacks, as a flat repository
#   wheels/   PyPI's stand-in: the wheels of requirements-mlflow.txt (the head node's MLflow server)
#   root/     the root file system as a directory: the system containers' lower layer (`container`)
#   rootfs.img, vmlinuz, initrd.img: a raw ext4 disk with its kernel, for the VMs (`vm`)
# Usage: build_boot_image.sh [container|vm] (default container). Prints the image's directory.
# Cached under ~/.cache/boot-vm like the Horovod wheel: the root file system as a tarball keyed by
# the package list (minutes, once), the rest keyed by that and this script's inputs (seconds).
# Needs root (mmdebstrap's root mode) and Debian's archive for the first build.
set -euo pipefail

kind=${1:-container}
case $kind in container | vm) ;; *) echo "usage: $0 [container|vm]" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
# What only the boot test uses, so not in tools/setup_system.sh: the image (mmdebstrap), the system
# containers (systemd-nspawn), the flat repositories (dpkg-scanpackages, apt-ftparchive), the VMs'
# overlay disks (qemu-img) and seeds (genisoimage).
missing=()
for tool in mmdebstrap:mmdebstrap systemd-nspawn:systemd-container dpkg-scanpackages:dpkg-dev \
  apt-ftparchive:apt-utils qemu-img:qemu-utils genisoimage:genisoimage gpg:gnupg; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing the boot test's tools: ${missing[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
slurm_debs=$("$here/build_slurm_packages.sh")
source_dir=$here/boot_image
image_pin=$here/../tests/infra/data/slurm-u.pin # the ubuntu-hpc image's (vendored)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/boot-vm
base_key=$(grep -v "^#" "$source_dir/packages" | sha256sum | cut -c1-16) # comments aside
base=$cache/rootfs-$base_key.tar
key=$( (echo "$base_key" && cat "$0" "$image_pin" "$source_dir/archive-packages" "$here/../requirements-mlflow.txt" && ls "$slurm_debs" &&
  cd "$source_dir" && find rootfs -type f | sort | xargs sha256sum) | sha256sum | cut -c1-16)
target=$cache/image-$key
if [ -f "$target/.complete-$kind" ]; then
  echo "$target"
  exit 0
fi
mkdir -p "$cache"
start=$SECONDS

if [ ! -f "$base" ]; then
  echo "building the boot test's root file system into $base (minutes, once)" >&2
  work=$(mktemp -d "$cache/work.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Created-By: Packages' | grep -v -- '-security' | head -n1)
  mmdebstrap --variant=apt --include="$(grep -v '^#' "$source_dir/packages" | paste -sd, -)" \
    bookworm "$work/base.tar" "$mirror" >&2
  mv "$work/base.tar" "$base"
  rm -rf "$work"
  trap - EXIT
  echo "root file system: $((SECONDS - start)) s, $(du -m "$base" | cut -f1) MiB" >&2
fi

# The root directory, made once per key and shared by both kinds.
if [ ! -f "$target/.complete-root" ]; then
  rm -rf "$target"
  mkdir -p "$target"
  root=$target/root
  mkdir "$root"
  tar -xf "$base" -C "$root"
  cp -a "$source_dir/rootfs/." "$root/"
  install -D -m 0644 "$image_pin" "$root/etc/apt/preferences.d/slurm-repository-pin-990"
  : >"$root/etc/fstab"
  # No resolver: the test network has none, and Azure's names are in /etc/hosts (the seed's vendor
  # data). The image's resolver cost every lookup a time-out (apt, munged).
  rm -f "$root/etc/resolv.conf" && : >"$root/etc/resolv.conf"
  systemctl --root="$root" enable boot-hardware.service >/dev/null 2>&1
  # apt's periodic jobs would hold its lock while cloud-init installs packages.
  systemctl --root="$root" mask apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1

  # The distribution's packages, resolved against the image's own package database.
  mkdir -p "$target/archive" "$target/slurm"
  cp "$slurm_debs"/*.deb "$target/slurm/"
  apt_image=(-o "Dir::State::status=$root/var/lib/dpkg/status" -o "Dir::Cache::archives=$target/archive"
    -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
  mkdir -p "$target/archive/partial"
  # shellcheck disable=SC2046  # one package name a line
  DEBIAN_FRONTEND=noninteractive apt-get "${apt_image[@]}" install --download-only -y -qq --no-install-recommends \
    $(grep -v '^#' "$source_dir/archive-packages") \
    "$target"/slurm/slurm-smd_*.deb "$target"/slurm/slurm-smd-{client,slurmd,slurmctld,slurmdbd}_*.deb >/dev/null
  rm -rf "$target/archive/partial" "$target/archive/lock"
  rm -f "$target"/archive/slurm-smd*.deb
  (cd "$target/archive" && dpkg-scanpackages --multiversion . 2>/dev/null >Packages)
  printf 'Origin: boot-test\nLabel: boot-test\nSuite: boot-test\nCodename: boot-test\nArchitectures: amd64 all\nSHA256:\n %s %s Packages\n' \
    "$(sha256sum <"$target/archive/Packages" | cut -d' ' -f1)" "$(stat -c %s "$target/archive/Packages")" >"$target/archive/Release"
  # PyPI's stand-in for the head node's MLflow environment: the pinned requirements' wheels, for this
  # machine's Python, which is the image's (Debian 12's 3.11, glibc 2.36).
  python3 -m pip download -q --disable-pip-version-check --only-binary :all: \
    -r "$here/../requirements-mlflow.txt" -d "$target/wheels" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  ls "$target"/wheels/mlflow-*.whl >/dev/null
  touch "$target/.complete-root"
fi

if [ "$kind" = vm ]; then
  work=$(mktemp -d "$cache/work.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  cp -a "$target/root" "$work/root"
  echo "/dev/vda / ext4 defaults,errors=remount-ro 0 1" >"$work/root/etc/fstab"
  cp -L "$work/root/vmlinuz" "$target/vmlinuz"
  cp -L "$work/root/initrd.img" "$target/initrd.img"
  # The disk: sparse, as large as the nodes' health check wants free space (50 GB, infra/contract.py),
  # with few inodes so that its tables stay small (the VMs' cloud-init could not grow a small one).
  mke2fs -q -t ext4 -N 262144 -E lazy_itable_init=1,lazy_journal_init=1 -d "$work/root" -L root "$target/rootfs.img" 64G
  rm -rf "$work"
  trap - EXIT
fi
touch "$target/.complete-$kind"
echo "image ($kind): $((SECONDS - start)) s" >&2
# Keep only the current ones: each is most of a gigabyte.
find "$cache" -mindepth 1 -maxdepth 1 ! -name "image-$key" ! -name "rootfs-$base_key.tar" ! -name "slurm-*" -exec rm -rf {} +
echo "$target"
