"""A training job from the operator's side: its spec and submission, the batch script (`job.sh`), the
allocation it asks Slurm for, the preflight checks, the user's workdir, the runs on the shared file
system, following a run, and downloading its results.

Runs on the operator's machine. May import ``dtrain``'s shared modules, ``dtrain.cluster``,
``dtrain.remote`` (the job tools it ships) and ``training``'s framework-free modules; never
``dtrain.local``.
"""
