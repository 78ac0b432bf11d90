"""Model parallelism for ``training.model_parallel``: the layout and its mesh, TP/FSDP/activation
checkpointing, pipelines, sharded checkpoints, and per-rank memory accounting.

Modules: :mod:`.layout` (flags -> :class:`~.layout.Layout` -> DeviceMesh), :mod:`.sharding`
(tensor parallel, FSDP2, activation checkpointing), :mod:`.pipeline` (stage split and schedules),
:mod:`training.checkpoint.sharded` (DCP checkpoints that reshard), :mod:`.memory` (parameters, bytes, peak
memory per rank, MFU).
"""
