"""Benchmark harness for issue 5: every figure beside a baseline measured in the same run.

Entry point: ``python -m bench`` (see ``bench/__main__.py`` and docs/performance.md).
"""
