"""The run's bookkeeping: how every job starts and ends (``job``), the training loop's framework-neutral
part (``loop``), the LR schedule, metrics, curves, slow ranks, the deployable export and the checks of
outputs.

Runs on the nodes. Framework-neutral (PyTorch and TensorFlow are imported only where a function needs
them); may import ``training.config``, ``training.checkpoint``, ``training.world``.
"""
