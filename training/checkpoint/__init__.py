"""The checkpoint formats, side by side: atomic self-verifying files (``files``), rank 0's background
writer (``writer``) and the model-parallel job's sharded, resharding DCP checkpoints (``sharded``).

Runs on the nodes. ``files`` and ``writer`` are framework-neutral; ``sharded`` imports PyTorch.
"""
