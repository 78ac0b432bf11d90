"""The data-parallel jobs' flags (``args``) and the typed settings built once from them (``settings``).

Runs wherever a job runs. Standard library only; may import ``training.errors`` and
``training.exit_status``.
"""
