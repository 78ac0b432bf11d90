"""Benchmarks: every figure beside a baseline measured in the same run.

``python -m bench`` (``bench/__main__.py``, ``make bench``) runs the CPU figures; ``python -m bench.gpu``
(``make bench-gpu``) the GPU ones. Grouped: ``harness/`` (processes, figures, reports, the scaling
model), ``cpu/`` and ``gpu/`` (the sections and their workers), ``results/`` (what a run wrote, kept).

Runs on a developer's machine with the training environment (``cpu/staging`` with the operator's).
May import ``training`` and, for staging, ``dtrain``; nothing imports ``bench``.
"""
