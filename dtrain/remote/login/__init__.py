"""Operator tools: what the operator's commands run on the login node over SSH (the runs on the shared
file system, as JSON).

Runs on the head (login) node. Standard library only; imports nothing (see dtrain/remote/__init__.py).
"""
