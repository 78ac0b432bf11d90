#!/bin/bash
# Joins this node to Slurm: slurmd fetches its configuration from slurmctld (configless) under
# this node's Slurm name. Safe to re-run.
set -euo pipefail

SLURMCTLD_ADDRESS=@SLURMCTLD_ADDRESS@
readonly ENV_FILE=/etc/default/slurmd-configless
readonly MUNGE_KEY=/usr/local/sbin/munge-key

# The scale set names this machine computerNamePrefix + its instance id in base 36, whose letters
# Azure may write in upper case; Slurm's node names are the lower-case form (Slurm compares names
# case-sensitively, DNS does not).
node=$(hostname -s | tr '[:upper:]' '[:lower:]')
printf 'SLURMD_NODENAME=%s\nSLURMCTLD_ADDRESS=%s\n' "$node" "$SLURMCTLD_ADDRESS" >"$ENV_FILE"
# The munge package started munged with a key of its own: the cluster's comes from Key Vault.
"$MUNGE_KEY"
systemctl restart munge
systemctl daemon-reload
systemctl enable slurmd
systemctl restart slurmd
