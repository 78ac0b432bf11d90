"""Model parallelism for ``training.model_parallel``: the mesh, TP/FSDP/activation checkpointing,
pipelines, sharded checkpoints, and per-rank memory accounting.

Modules: :mod:`.mesh` (a :class:`training.config.layout.Layout` -> the DeviceMesh), :mod:`.sharding`
(tensor parallel, FSDP2, activation checkpointing), :mod:`.pipeline` (stage split and schedules),
:mod:`training.checkpoint.sharded` (DCP checkpoints that reshard), :mod:`.memory` (parameters, bytes, peak
memory per rank, MFU). The vocabulary they share with the parser (the layout, pipeline schedules,
activation-checkpointing modes, model shapes) is framework-free, in training/config/.

Runs on the nodes. Imports PyTorch.
"""
