"""Code that runs on the cluster's hosts (the NFS server, the head node, the nodes), not on the
operator's machine.

One folder for all of it, so that what a host runs is in one place: infra/ reads these files to
install them through cloud-init (scripts with @NAME@ placeholders are rendered first, see
infra/cloud_init/_common.py), and the local cluster runs the same files in place. Python here is
standard library only and runs on the hosts' python3 (Ubuntu 22.04's 3.10), outside any virtual
environment; shell scripts are bash and pass shellcheck. Nothing here may import from the rest of
`scripts` or from `infra`.
"""
