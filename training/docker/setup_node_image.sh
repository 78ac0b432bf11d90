#!/usr/bin/env bash
# Runtime setup shared by the framework images; runs after /opt/venv is in place.
#
#  * rdma-core, ibverbs-providers, libibverbs1, librdmacm1, ibverbs-utils, infiniband-diags:
#    the InfiniBand user-space stack NCCL's IB transport loads (the node's HPC image provides
#    the kernel side; the container sees /dev/infiniband when started with it), plus
#    ibv_devinfo/ibstat for preflight checks.
#  * openssh-server on port 12345: horovodrun in the first container starts the workers in the
#    others over SSH; a non-default port leaves the host's own sshd on 22 alone (containers
#    run with the host network). Keys only: authorized_keys is mounted at run time.
#  * SSH host keys are made when a container starts (see the Dockerfiles' CMD), never baked
#    into the image, where every copy would share them.
#  * CUDA libraries that the frameworks install as pip wheels (nvidia-*) are registered with
#    the dynamic linker, so Horovod's NCCL and CUDA libraries resolve whatever is imported first.
#  * apt packages are not version-pinned: Ubuntu's archive drops superseded versions, so an
#    exact pin breaks the build within weeks; the pinned base image fixes the release.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends \
  ca-certificates openssh-server openssh-client \
  rdma-core ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils infiniband-diags
rm -rf /var/lib/apt/lists/*

mkdir -p /run/sshd /root/.ssh
chmod 700 /root/.ssh
cat > /etc/ssh/sshd_config.d/horovod.conf <<'CONF'
Port 12345
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
# horovodrun passes the job's environment (NCCL_*, HOROVOD_*) on its command line, not via SSH.
PermitUserEnvironment no
CONF
cat > /etc/ssh/ssh_config.d/horovod.conf <<'CONF'
Host *
    Port 12345
    # Nodes are created and replaced by the scale set: their host keys are new every time.
    StrictHostKeyChecking accept-new
    UserKnownHostsFile /root/.ssh/known_hosts
CONF
rm -f /etc/ssh/ssh_host_*
# SSH sessions do not inherit the image's ENV; PAM reads /etc/environment for them.
echo 'PATH="/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"' > /etc/environment
echo 'PYTHONPATH="/workspace"' >> /etc/environment

find /opt/venv -type d -path '*/site-packages/nvidia/*/lib' | sort > /etc/ld.so.conf.d/nvidia-pip.conf
test -s /etc/ld.so.conf.d/nvidia-pip.conf
ldconfig
