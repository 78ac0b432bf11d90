"""The CPU sections of ``python -m bench`` and their workers: overhead, allreduce, communication,
input pipeline, decode speed, frameworks, staging, local SGD and model parallelism.

Runs on a developer's machine (CPU, gloo). May import ``bench.harness`` and ``training``.
"""
