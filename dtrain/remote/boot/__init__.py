"""What a host runs at boot, installed by cloud-init, each script beside the systemd unit that starts it:
registry login, munge key, NFS mount and data setup, NVMe RAID, slurmd setup, the Spot agent, blob-pull.

Runs on the cluster's hosts. Standard library only; imports nothing (see dtrain/remote/__init__.py).
"""
