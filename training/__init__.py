"""Data-parallel ResNet training jobs with Horovod (PyTorch, TensorFlow, Keras).

Run one with ``python -m training.pytorch``, ``python -m training.tensorflow`` or
``python -m training.keras``; all three take the flags defined in :mod:`training.args`.
Framework-neutral pieces (data, LR schedule, checkpoints, metrics, the step bookkeeping, the
checks of outputs, errors and exit status, liveness) import neither PyTorch nor TensorFlow, so
each job pays only for its own framework.
"""
