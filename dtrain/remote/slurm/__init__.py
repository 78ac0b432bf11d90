"""Slurm's hooks on the cluster: power saving (SuspendProgram/ResumeProgram), the node health check
and the job epilog.

Runs on the head node and the nodes, called by slurmctld and slurmd. Standard library only; imports
nothing (see dtrain/remote/__init__.py).
"""
