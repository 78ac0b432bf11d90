"""Operator tools: cluster description, data staging, image builds, job launch, local cluster, demo.

Each module is importable and has a thin argparse CLI: `python -m scripts.<module> --help`.
"""
