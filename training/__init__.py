"""The training jobs that run on the nodes, inside the framework images (or the training venv).

A module at the top of ``training/`` is a command, ``python -m training.<name>``: the data-parallel
jobs ``pytorch``, ``tensorflow`` and ``keras``, the model-parallel job ``model_parallel`` (beside
``pytorch``, so that merging the two trainers is a local change), ``predict`` (scores images with an
export), and the launcher wrappers ``horovodrun`` and ``torchrun``. ``exit_status`` is the product's
one exit-status table and ``errors`` the job's errors. The parts are grouped:

- ``config/``: the flags and the typed settings built from them.
- ``data/``: ImageNet folders, decode (CPU and GPU), transcode, text tokens.
- ``checkpoint/``: the checkpoint formats side by side (atomic files, the background writer, sharded DCP).
- ``run/``: the run's bookkeeping: start and end, loop, schedule, metrics, curves, slow ranks, export,
  outputs.
- ``world/``: the distributed world: backends, liveness, preemption, launchers, helper lifetimes.
- ``torch/``: PyTorch's models, transformer, replica sync, profiling, the compute clock and ``parallel/``
  layouts.
- ``tf/``: what the TensorFlow and Keras jobs share, and their models.

May import: the training environment's packages (PyTorch, TensorFlow, Horovod), each job only its own
framework (the framework-neutral parts import neither); never ``dtrain`` or ``infra``.
"""

import os

# TensorFlow reads this as it loads: without it, its C++ INFO lines (oneDNN, CPU features) come before
# anything a job prints, `--help` and one-line errors included. Set here, before any job (or the
# horovodrun wrapper, whose Horovod imports TensorFlow) imports it; a value already set wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # errors only, as training.predict wants; job.sh sets 1
