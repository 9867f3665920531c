"""Wall time of the fleet simulator (agent/fleet/plan/sim_fleet.py, `gpuwarden plan simulate`) and how it grows with
nodes and simulated days.

Targets: 128 racks x 18 nodes (2,304) for 30 days, and 556 racks x 18 (10,008) for 30 days, each under a minute, for
both policies of the comparison (2 spares per rack with 16-node slices; no spares with 18-node slices). Each target
is run --repeats times (median, min, max); the growth rows, with 2 spares and 16-node slices, once each. Also
printed: the setup alone (the fleet written to the local scheduler, the first placement: a run of 1/1000 day), the
failures simulated and the time per failure (the setup included). Exits 1 when a target's median is a minute or
more.

    .venv/bin/python bench/simulate.py [--repeats 3] [--nodes 1008,2304,5004,10008] [--days 7,30,90]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwarden.agent.fleet.plan.sim_config import Policy, SimConfig  # noqa: E402
from gpuwarden.agent.fleet.plan.sim_fleet import simulate  # noqa: E402

PER_RACK = 18
POLICY = Policy(2, 16)
POLICIES = (Policy(2, 16), Policy(0, 18))
TARGET_S = 60.0


def timed(racks: int, days: float, policy: Policy) -> tuple[float, int]:
    t = time.perf_counter()
    report = simulate(SimConfig(racks=racks, nodes_per_rack=PER_RACK, days=days, seed=1), policy)
    return time.perf_counter() - t, report.failures


def row(label: str, racks: int, days: float, repeats: int = 1, policy: Policy = POLICY) -> float:
    runs = [timed(racks, days, policy) for _ in range(repeats)]
    walls = [w for w, _ in runs]
    failures = runs[0][1]
    med = statistics.median(walls)
    per = f"{1000 * med / failures:6.1f} ms" if failures else "     -"  # the setup included
    spread = f" (min {min(walls):.2f}, max {max(walls):.2f}, {repeats} runs)" if repeats > 1 else ""
    print(f"{label:<30} {racks * PER_RACK:>7,} nodes {days:>7g} days {failures:>6,} failures "
          f"{med:>7.2f} s{spread}  per failure {per}", flush=True)
    return med


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nodes", default="1008,2304,5004,10008", help="fleet sizes (multiples of 18)")
    p.add_argument("--days", default="7,30,90", help="simulated days, on 2,304 nodes")
    a = p.parse_args()
    print(f"{PER_RACK} nodes per rack, node MTBI 490 days, repair median 48 h, seed 1")
    slow = []
    for racks in (128, 556):
        for policy in POLICIES:
            if row(f"target {policy.name}", racks, 30, a.repeats, policy) >= TARGET_S:
                slow.append(f"{racks * PER_RACK:,} nodes, {policy.name}")
    print(f"\ngrowth: {POLICY.name}")
    for n in (int(x) for x in a.nodes.split(",")):
        row("setup only (1/1000 day)", n // PER_RACK, 0.001)
    print()
    for n in (int(x) for x in a.nodes.split(",")):
        row("nodes, 30 days", n // PER_RACK, 30)
    print()
    for d in (float(x) for x in a.days.split(",")):
        row("days, 2,304 nodes", 128, d)
    if slow:
        print(f"over {TARGET_S:g} s: {'; '.join(slow)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
