"""Data-parallel ResNet training jobs with Horovod (PyTorch, TensorFlow, Keras).

Run one with ``python -m training.pytorch``, ``python -m training.tensorflow`` or
``python -m training.keras``; all three take the flags defined in :mod:`training.args`.
Framework-neutral pieces (data, LR schedule, checkpoints, metrics, the step bookkeeping, the
checks of outputs, errors and exit status, liveness) import neither PyTorch nor TensorFlow, so
each job pays only for its own framework.
"""

import os

# TensorFlow reads this as it loads: without it, its C++ INFO lines (oneDNN, CPU features) come before
# anything a job prints, `--help` and one-line errors included. Set here, before any job (or the
# horovodrun wrapper, whose Horovod imports TensorFlow) imports it; a value already set wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # errors only, as training.predict wants; job.sh sets 1
