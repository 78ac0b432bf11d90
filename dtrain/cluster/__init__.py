"""A cluster from the operator's side: its description (the one seam between "a cluster exists" and
everything that uses it), SSH through the jump host, Slurm's commands over SSH, blob access, Slurm's
time syntax.

Runs on the operator's machine. May import ``dtrain``'s shared modules, ``infra.contract`` and
``infra.slurm_time``; never ``dtrain.local`` (the Azure path and the local cluster share this code), nor
``dtrain.cli_entry`` or argparse (the `cluster` verb is dtrain/cli/cluster.py).
"""
