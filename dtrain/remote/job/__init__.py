"""The job's tools, copied into each run directory by `launch` and run by its batch script: the output
annotator, srun-ssh for horovodrun, record-run, upload-results, nvme-copy.

Runs on the nodes, inside a Slurm job. Standard library only; imports nothing (see
dtrain/remote/__init__.py).
"""
