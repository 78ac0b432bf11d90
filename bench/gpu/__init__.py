"""``python -m bench.gpu``: our GPU jobs beside plain PyTorch on one CUDA GPU (``run``), its sections,
baselines, report and the JPEG end-to-end rows.

Runs on a GPU machine. May import ``bench.harness`` and ``training``.
"""
