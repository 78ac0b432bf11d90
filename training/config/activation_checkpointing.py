"""The activation-checkpointing modes of the mesh layouts, by name (``--activation-checkpointing``).

``none`` keeps every activation; ``selective`` keeps the outputs of matmuls, convolutions, attention and
collectives and recomputes the cheap element-wise work; ``full`` keeps only each block's input and
recomputes the block in backward (training/torch/parallel/sharding.py applies them). ``auto`` picks the
least recomputation whose memory estimate fits the GPU (training/torch/parallel/memory.py), once the
device is known.

Runs wherever a job runs. Standard library only.
"""

AUTO = "auto"
AC_MODES = ("none", "selective", "full")  # least recomputation first: the order in which auto tries them
