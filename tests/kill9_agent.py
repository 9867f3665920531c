"""`gpuwarden run` as the kill -9 tests start it: the real agent, its scheduler slowed so that a kill lands in the
middle of remediation. Usage: kill9_agent.py DELAY_S [--only CALL,CALL...] -- <gpuwarden arguments>.

The scheduler is the adapter `gpuwarden run` builds from its config (the local adapter, agent/act/adapters/local.py, in
the remediation test; the real Slurm adapter in the job test). Each of its calls waits DELAY_S first; with --only,
only the calls named (e.g. `--only mark_job,signal_job,requeue_job,cancel_job`: the job's action is held back, while
the reads and the node's own cordon and quarantine go as usual)."""
from __future__ import annotations

import sys
import time


class Slow:
    """The scheduler's calls (all, or those in `only`) wait `delay_s` first: a busy slurmctld."""

    def __init__(self, inner, delay_s: float, only: frozenset[str] | None = None):
        self._inner, self._delay_s, self._only = inner, delay_s, only
        self.name, self.timeout_s = getattr(inner, "name", "slow"), getattr(inner, "timeout_s", 5.0)

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        if not callable(value) or (self._only is not None and attr not in self._only):
            return value

        def call(*args, **kwargs):
            time.sleep(self._delay_s)
            return value(*args, **kwargs)

        return call


def parse(argv: list[str]) -> tuple[float, frozenset[str] | None, list[str]]:
    """(the delay, the calls to slow or None for all, gpuwarden's arguments) of `DELAY_S [--only A,B] -- ARGS`."""
    if "--" not in argv:
        sys.exit(f"usage: kill9_agent.py DELAY_S [--only CALL,CALL...] -- <gpuwarden arguments> (no -- in {argv})")
    cut = argv.index("--")
    own, rest = argv[:cut], argv[cut + 1:]
    if len(own) == 1:
        return float(own[0]), None, rest
    if len(own) == 3 and own[1] == "--only" and all(own[2].split(",")):
        return float(own[0]), frozenset(own[2].split(",")), rest
    sys.exit(f"usage: kill9_agent.py DELAY_S [--only CALL,CALL...] -- <gpuwarden arguments> (got {own})")


def main() -> int:
    delay_s, only, rest = parse(sys.argv[1:])
    import gpuwarden.agent.act.adapters as adapters
    from gpuwarden.agent.cli.main import main as cli

    # `gpuwarden run` imports adapters.build when it builds its scheduler: the slowed one is what it finds.
    build = adapters.build
    adapters.build = lambda name, table, state_dir: Slow(build(name, table, state_dir), delay_s, only)
    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
