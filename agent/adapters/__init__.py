"""Scheduler adapters: how the node's state reaches the scheduler (local record, Slurm, Kubernetes)."""
