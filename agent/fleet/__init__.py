"""Tools over many nodes, run from one place: the multi-node NCCL sweep (`sweep/`) and fleet planning (`plan/`:
capacity, risk, the fleet simulator, defrag).

It may import the core, the sources, the state, the checks, the node, the jobs and the remediation (`act`: the
simulator drives the real state machine and remediation engine); it is independent of the daemon (neither imports
the other), and only the command line imports it.
"""
