"""`gpuwarden run` as the kill -9 test starts it: the real agent, its scheduler slowed so that a kill lands in the
middle of remediation. Usage: kill9_agent.py SCHEDULER_JSON DELAY_S -- <gpuwarden arguments>.

SCHEDULER_JSON names the scheduler's file: with the local adapter installed (agent/adapters/local.py with the whole
adapter contract) the agent's own local adapter is used, built from the config as `gpuwarden run` builds it;
otherwise the test's dict scheduler (tests/fake_scheduler.py) kept in that file stands for it."""
from __future__ import annotations

import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    sched_path, delay_s, rest = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[4:]
    import gpuwarden.agent.run as run
    from gpuwarden.agent.adapters import build
    from gpuwarden.agent.adapters.local import LocalAdapter

    if hasattr(LocalAdapter, "take_spare"):
        run.build_adapter = lambda name, table, state_dir: Slow(build(name, table, state_dir), delay_s)
    else:
        from fake_scheduler import DictScheduler

        run.build_adapter = lambda name, table, state_dir: Slow(DictScheduler(path=sched_path), delay_s)
    try:
        import gpuwarden.agent.breaker  # noqa: F401
    except ImportError:  # the breaker's own module is not installed: one that lets every cordon through
        stand_in = types.ModuleType("gpuwarden.agent.breaker")
        stand_in.BreakerPolicy = lambda **kw: kw
        stand_in.judge = lambda fleet, node, domain, now, policy, reset_at=None: types.SimpleNamespace(
            allow=True, reason="allowed", cluster=(1, len(fleet)), domain=None)
        sys.modules["gpuwarden.agent.breaker"] = stand_in
    from gpuwarden.agent.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
