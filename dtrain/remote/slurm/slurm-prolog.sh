#!/bin/bash
# Slurm's Prolog: slurmd runs it as root on every node of a job's allocation before the job starts there
# (slurm.conf PrologFlags=Alloc), with SLURM_JOB_ID and SLURM_JOB_GPUS (the node's GPU indices that
# Slurm gave the job) in the environment.
#
# It writes the job's id into the DCGM exporter's job mapping: one file per GPU index, one job id per
# line (NVIDIA's --hpc-job-mapping-dir convention), from which the exporter labels that GPU's series
# hpc_job="<id>", so that Prometheus answers {hpc_job="<id>"} with this job's GPUs only. The epilog
# (slurm-epilog.sh) takes the id out again. The local cluster's GPU stand-in reads the same files.
#
# The labels are a convenience: nothing here may hold a job back, so it always exits 0 (a non-zero
# prolog would drain the node and requeue the job).
set -uo pipefail

# slurmd sets no search path for its prologs and epilogs.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
readonly MAPPING_DIR=${DCGM_HPC_JOB_MAPPING_DIR:-/run/dcgm-job-map}

job=${SLURM_JOB_ID:-}
gpus=${SLURM_JOB_GPUS:-}
if [[ ! $job =~ ^[0-9]+$ ]] || [ -z "$gpus" ]; then
  exit 0
fi
if ! mkdir -p "$MAPPING_DIR" 2>/dev/null; then
  echo "slurm-prolog: cannot make $MAPPING_DIR: GPU series of job $job go unlabelled" >&2
  exit 0
fi
for index in ${gpus//,/ }; do
  [[ $index =~ ^[0-9]+$ ]] || continue
  grep -qxF "$job" "$MAPPING_DIR/$index" 2>/dev/null || echo "$job" >>"$MAPPING_DIR/$index"
done
exit 0
