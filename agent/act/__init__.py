"""Acting on a node's state: the remediation engine (`remediation`: the intents of a transition carried out once,
idempotently, through the scheduler), the breaker that keeps a bad signal from draining the fleet (`breaker`), spares
(`spares`), the recovery ladder (`recovery`: GPU reset, reboot), a transition's intents (`intents`), and the
scheduler adapters (`adapters/`: local, Slurm, Kubernetes).

It may import the core, the sources, the state, the node and the jobs; the daemon, the fleet tools and the command
line import it, never the other way round.
"""
