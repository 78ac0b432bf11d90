#!/usr/bin/env bash
# The boot test's Slurm packages, under the names and layout Microsoft's Slurm repository serves them:
# SchedMD's own Debian packaging (the debian/ directory that Slurm's release tarballs carry since 23.11,
# which builds slurm-smd, slurm-smd-client, slurm-smd-slurmd, slurm-smd-slurmctld, ...), built for the
# boot image's Debian (bookworm, as this machine) from the release tarball that Debian's archive keeps
# for trixie (24.11.5, a release the renderer supports: infra/cloud_init/slurm_packages.py).
#
# Why build: Debian 12 has Slurm 22.05 under Debian's names; trixie's binaries need trixie's C library.
# Cached under ~/.cache/boot-vm/slurm-<version> like the Horovod wheel (24 minutes on 2 busy cores,
# once); prints the directory of the .deb files. Needs root (apt-get build-dep) and Debian's archive.
set -euo pipefail

version=24.11.5
revision=1
# The upstream tarball, as Debian's trixie keeps it, checked by its digest (Debian's .dsc lists it).
tarball=slurm-wlm_$version.orig.tar.gz
tarball_sha256=e1a5547edd212c38b5e3230a284133f777b32746551f094aaa81cc4af375e332
cache=${XDG_CACHE_HOME:-$HOME/.cache}/boot-vm
target=$cache/slurm-$version-$revision
if [ -f "$target/.complete" ]; then
  echo "$target"
  exit 0
fi
mkdir -p "$cache"
work=$(mktemp -d "$cache/slurm-work.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# trixie's source index beside this machine's own apt configuration, in a private state directory:
# the machine's package sources are read, never changed.
mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Created-By: Packages' | grep -v -- '-security' | head -n1)
mkdir -p "$work/apt/lists/partial"
echo "deb-src ${mirror%/} trixie main" >"$work/apt/sources.list"
apt_private=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=-"
  -o "Dir::State::Lists=$work/apt/lists" -o "APT::Sandbox::User=root")
echo "building Slurm $version packages into $target (about 25 minutes on 2 busy cores, once)" >&2
apt-get "${apt_private[@]}" update -qq
(cd "$work" && apt-get "${apt_private[@]}" source --download-only --tar-only -qq "slurm-wlm" >/dev/null 2>&1) || true
if ! echo "$tarball_sha256  $work/$tarball" | sha256sum --check --status 2>/dev/null; then
  echo "error: $tarball from Debian's trixie sources is missing or not the release checked ($tarball_sha256)" >&2
  exit 1
fi
mkdir "$work/src"
tar -xzf "$work/$tarball" -C "$work/src" --strip-components=1
test -f "$work/src/debian/control" || { echo "error: $tarball carries no debian/ packaging" >&2; exit 1; }

DEBIAN_FRONTEND=noninteractive apt-get build-dep -y -qq "$work/src" >/dev/null
(cd "$work/src" && DEB_BUILD_OPTIONS="nocheck nodoc noddebs parallel=$(nproc)" \
  dpkg-buildpackage -b -uc -us >"$work/build.log" 2>&1) || { tail -n 40 "$work/build.log" >&2; exit 1; }

mkdir "$work/debs"
mv "$work"/*.deb "$work/debs/"
rm -rf "$target"
mv "$work/debs" "$target"
touch "$target/.complete"
echo "Slurm $version packages: $((SECONDS - start)) s" >&2
echo "$target"
