#!/bin/busybox sh
# shellcheck shell=dash
# /init of the NVMe RAID test VM (tests/infra/nvme_vm.py). Loads the drivers, mounts this machine's
# root read-only over 9p as the VM's root (so the VM runs the very mdadm, mkfs.xfs, udev and bash
# the tests use) with tmpfs on /tmp and /run, and the test's work directory writable at its own path,
# then runs WORK/boot.sh as the boot's work and powers off.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
while read -r module; do
  insmod "/modules/$module" 2>/dev/null || true # crc32c-intel needs SSE 4.2; the generic one serves
done </modules/order
work=$(sed -n 's/.*vm\.work=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,ro host /host
mount --move /proc /host/proc
mount --move /sys /host/sys
mount --move /dev /host/dev
ln -s /proc/self/fd /host/dev/fd
mount -t tmpfs tmp /host/tmp
mount -t tmpfs run /host/run
mkdir -p "/host$work"
mount -t 9p -o trans=virtio,version=9p2000.L work "/host$work"
# PID 1 in the new root, not a chroot: udevd refuses to work in a chroot. The host's static busybox
# powers off at once, before anything more is read from the 9p root.
# shellcheck disable=SC2016 # expanded by the new shell, with the work directory as $0
exec switch_root /host /bin/busybox sh -c \
  'bash "$0/boot.sh" >"$0/boot.log" 2>&1; echo $? >"$0/rc"; sync; exec /bin/busybox poweroff -f' "$work"
