#!/usr/bin/env bash
# System packages the tests and the local cluster need. Installs only what is missing, so a second
# run costs nothing.
set -euo pipefail

declare -A wanted=(
  [cloud-init]=cloud-init      # validates rendered cloud-config documents
  [shellcheck]=shellcheck      # lints the shell scripts embedded in them
  [sshd]=openssh-server        # local cluster nodes
  [ssh]=openssh-client
  [rsync]=rsync                # launch --workdir sends the user's code to the shared file system
  [ip]=iproute2                # network namespaces as nodes
  [tc]=iproute2                # `local up --link-rate`: slows the nodes' links (tbf)
  [systemd-analyze]=systemd    # verifies the systemd units in cloud-init documents
  [npm]=npm                    # Azurite
  [slurmctld]=slurmctld        # the local cluster's Slurm controller (Debian 12: Slurm 22.05)
  [slurmd]=slurmd              # one per local node
  [sinfo]=slurm-client         # sinfo, srun, sbatch, squeue, scontrol from the operator's side
  [munged]=munge               # Slurm's authentication
  [slurmdbd]=slurmdbd          # the local cluster's accounting daemon (sacct), in its head namespace
  [mariadbd]=mariadb-server    # slurmdbd's database there
  [mkfs.xfs]=xfsprogs          # the GPU nodes' NVMe volume, tested on a loop device and in a VM
  [mdadm]=mdadm                # its RAID 0
  [qemu-system-x86_64]=qemu-system-x86  # the VM that builds it over NVMe disks (tests/infra/nvme_vm.py)
  [busybox]=busybox-static     # that VM's initramfs
  [udevadm]=udev               # assembles the array at the VM's boot, as on a node
  [modprobe]=kmod              # orders the VM kernel's modules
  [prometheus]=prometheus      # the local cluster's telemetry, in its head namespace (dtrain/local/telemetry.py)
  [prometheus-node-exporter]=prometheus-node-exporter  # one per local node
  [chromium]=chromium          # renders MLflow's UI headless (tests/scripts/test_mlflow.py)
)
missing=()
for command in "${!wanted[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$command" >/dev/null 2>&1 || missing+=("${wanted[$command]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${missing[*]}; install them (as root): apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "installing system packages: ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
