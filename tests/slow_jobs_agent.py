"""`gpuwarden run` whose scheduler is slow to act on jobs, so that a kill -9 lands between a job intent's journal entry
and its action. Usage: slow_jobs_agent.py DELAY_S -- <gpuwarden arguments>.

The scheduler is the adapter `gpuwarden run` builds from its config (the real Slurm adapter in the job tests); each of
its calls that acts on a job (mark, signal, requeue, cancel) waits DELAY_S first. Its reads and the node's own calls
are not slowed: the node is quarantined as usual, and only the job's action is held back."""
from __future__ import annotations

import sys
import time

JOB_CALLS = ("mark_job", "signal_job", "requeue_job", "cancel_job")


class SlowJobs:
    def __init__(self, inner, delay_s: float):
        self._inner, self._delay_s = inner, delay_s
        self.name, self.timeout_s = getattr(inner, "name", "slow"), getattr(inner, "timeout_s", 5.0)

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        if attr not in JOB_CALLS:
            return value

        def call(*args, **kwargs):
            time.sleep(self._delay_s)
            return value(*args, **kwargs)

        return call


def main() -> int:
    delay_s, rest = float(sys.argv[1]), sys.argv[3:]
    import gpuwarden.agent.adapters as adapters
    from gpuwarden.agent.cli import main as cli

    build = adapters.build
    adapters.build = lambda name, table, state_dir: SlowJobs(build(name, table, state_dir), delay_s)
    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
