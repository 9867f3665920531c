"""`gpuwarden run` as the kill -9 test starts it: the real agent, its scheduler slowed so that a kill lands in the
middle of remediation. Usage: kill9_agent.py DELAY_S -- <gpuwarden arguments>.

The scheduler is the agent's own local adapter (agent/adapters/local.py, SQLite), built from the config as
`gpuwarden run` builds it; each of its calls waits DELAY_S first."""
from __future__ import annotations

import sys
import time


class Slow:
    """Every scheduler call waits `delay_s` first: a busy slurmctld."""

    def __init__(self, inner, delay_s: float):
        self._inner, self._delay_s = inner, delay_s
        self.name, self.timeout_s = getattr(inner, "name", "slow"), getattr(inner, "timeout_s", 5.0)

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            time.sleep(self._delay_s)
            return value(*args, **kwargs)

        return call


def main() -> int:
    delay_s, rest = float(sys.argv[1]), sys.argv[3:]
    import gpuwarden.agent.adapters as adapters
    from gpuwarden.agent.cli import main as cli

    # `gpuwarden run` imports adapters.build when it builds its scheduler: the slowed one is what it finds.
    build = adapters.build
    adapters.build = lambda name, table, state_dir: Slow(build(name, table, state_dir), delay_s)
    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
