"""`gpuwarden checks`: every check once, with where it runs, its config table and the parts it has."""
from __future__ import annotations

import argparse

from gpuwarden.agent.core import config as config_mod
from gpuwarden.checks import ALL, BY_CONCERN, KERNEL_CONSUMERS, PASSIVE, all_specs

DESCRIPTION = ("List every check: where it runs (preflight level quick or full, the daemon's poll "
               "interval, or kmsg for the followed kernel log), what it looks at, and its config "
               "table [checks.NAME] with each key's default.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Every check once, with where it runs (preflight level quick|full; the daemon's poll interval or "kmsg" for
    the followed kernel log) and its one config table, which every form of the check reads."""
    tables = config_mod.defaults(all_specs())
    modes: dict[str, list[str]] = {}
    summaries: dict[str, str] = {}
    for spec in ALL:
        modes.setdefault(spec.name, []).append(spec.level)
        summaries.setdefault(spec.name, spec.summary)
    for p in PASSIVE:
        modes.setdefault(p.name, []).append(f"{p.interval_s:g}s")
        summaries.setdefault(p.name, p.summary)
    for c in KERNEL_CONSUMERS:
        if c.name not in {p.name for p in PASSIVE}:
            modes.setdefault(c.name, []).append("kmsg")
        summaries.setdefault(c.name, c.summary)
    width = max(len(name) for name in modes)
    for name, where in modes.items():
        keys = ", ".join(f"{k}={v!r}" for k, v in tables.checks[name].items()) or "-"
        borrowed = ", ".join(f"{owner}.{k}" for k, owner in tables.shared.get(name, {}).items())
        print(f"{name:<{width}} {'+'.join(where):<10} {summaries[name]}\n{'':<{width + 12}}[checks.{name}] {keys}"
              + (f"; reads {borrowed}" if borrowed else ""))
        print(f"{'':<{width + 12}}parts: {_parts(name)}")
    return 0


def _parts(name: str) -> str:
    """The parts a concern has (its Concern, checks/<name>.py): "preflight look, daemon poll, analyzer (nccl-tests)"."""
    concern = BY_CONCERN[name]
    parts = [label for label, has in (("preflight look", concern.level), ("daemon poll", concern.poll),
                                      ("kernel-log consumer", concern.kernel)) if has]
    if concern.analyze:
        parts.append(f"analyzer ({', '.join(concern.analyze)})")
    if concern.doom:
        parts.append(f"doom rule ({', '.join(concern.doom)})")
    return ", ".join(parts)
