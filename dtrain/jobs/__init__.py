"""A training job from the operator's side: the launch request (``launch_request.py``) and a task file
merged into it, its spec (``job_spec.py``) and submission, the batch script (`job.sh`) and the features
that fill its sections, the allocation it asks Slurm for, the preflight checks, the user's workdir, the
runs on the shared file system, following a run, and downloading its results.

Runs on the operator's machine. May import ``dtrain``'s shared modules, ``dtrain.cluster``,
``dtrain.remote`` (the job tools it ships) and ``training``'s framework-free modules; never
``dtrain.local``, ``dtrain.cli`` or ``dtrain.cli_entry``, nor argparse: the verbs read the flags and pass
typed requests. Its modules import no circle (tests/test_layout.py).
"""
