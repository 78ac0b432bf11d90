"""Code that runs on the cluster's hosts (the NFS server, the head node, the nodes), not on the
operator's machine, grouped by when it runs:

- ``boot/``: what cloud-init installs and runs at boot, with its systemd units beside it.
- ``slurm/``: Slurm's hooks (power saving, health check, epilog).
- ``job/``: the job's tools, copied into each run directory (and ``nvme-copy``, installed on nodes).
- ``login/``: what the operator's commands run on the login node (through SSH).

infra/ reads these files to install them through cloud-init (scripts with @NAME@ placeholders are
rendered first, see infra/cloud_init/_common.py), and the local cluster runs the same files in place.
Python here is standard library only and runs on the hosts' python3 (Ubuntu 22.04's 3.10), outside
any virtual environment; shell scripts are bash and pass shellcheck. Nothing here may import from the
rest of ``dtrain``, from ``training`` or from ``infra`` (tests/test_layout.py checks it); these
``__init__`` files are docstrings only.
"""
