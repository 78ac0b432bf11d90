"""Slurm's hooks on the cluster: power saving (SuspendProgram/ResumeProgram, and the head node's timer
that reaps nodes Slurm believes are off), the node health check and the job epilog.

Runs on the head node and the nodes, called by slurmctld, slurmd and systemd. Standard library only;
imports nothing (see dtrain/remote/__init__.py).
"""
