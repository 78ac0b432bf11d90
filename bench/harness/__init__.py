"""The harness shared by the benchmarks: starting measured processes (``proc``), figures and their JSON
and Markdown (``results``, ``report``, ``plot``), the scaling model, generated JPEGs, the jobs' steps.

Runs on a developer's machine. May import ``training``; never ``bench.cpu`` or ``bench.gpu``.
"""
