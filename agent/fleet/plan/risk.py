"""Fleet planning: how often a rack is interrupted, and how likely a job of N GPUs over T days meets a failure.

Interruptions of nodes are taken as independent with a constant rate (exponential times between them), so rates
add: a rack of N nodes is interrupted every MTBI_node / N (490 days / 18 nodes = 27.2 days), and some rack of R is
interrupted every MTBI_node / (N * R) (490 / (18 * 128) days = 5.1 hours). A GPU that fails with an annual
probability AFR survives T days with probability (1 - AFR)^(T / 365), so a job on G GPUs meets at least one failure
with probability 1 - (1 - AFR)^(G * T / 365): at 1 %/GPU/year over 30 days, 19 % for 256 GPUs, 57 % for 1,024.

The defaults are the worked example of GB200 NVL72 planning (18 compute trays per rack, 128 racks, a node MTBI of
490 days); the 1 % annual GPU failure rate with its 19 % / 57 % figures is the one Databricks published in its
GPU reliability write-up (2024). They are inputs to replace with a fleet's own figures, not measurements.
"""
from __future__ import annotations

import json
import math
from typing import Any, Sequence

from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.flag_values import parse_float, parse_int, split_list
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.fleet.plan.capacity import MAX_NODES_PER_RACK, MAX_RACKS

DAYS_PER_YEAR = 365.0
MAX_MTBI_DAYS = 1_000_000.0   # about 2,700 years
MAX_GPUS = 10_000_000
MAX_DAYS = 36_500.0           # a century
MAX_LIST = 64

JSON_VERSION = 1


# -- the model (pure) ---------------------------------------------------------------------------------------------
def rack_mtbi_days(node_mtbi_days: float, nodes_per_rack: int) -> float:
    """Mean time between interruptions of one rack: independent nodes' rates add."""
    return node_mtbi_days / nodes_per_rack


def fleet_rack_interval_hours(node_mtbi_days: float, nodes_per_rack: int, racks: int) -> float:
    """Mean time between interruptions of some rack among `racks`, in hours."""
    return node_mtbi_days / (nodes_per_rack * racks) * 24.0


def p_at_least_one_failure(gpus: int, days: float, afr: float) -> float:
    """1 - (1 - AFR)^(gpus * days / 365), AFR a fraction in [0, 1); log1p/expm1 keep small rates exact."""
    return -math.expm1(gpus * days / DAYS_PER_YEAR * math.log1p(-afr))


def expected_failures(gpus: int, days: float, afr: float) -> float:
    """Expected GPU failures in the window at the rate that gives AFR in a year (-ln(1 - AFR) per GPU-year)."""
    return gpus * days / DAYS_PER_YEAR * -math.log1p(-afr)


@dataclass(frozen=True)
class Risk:
    node_mtbi_days: float
    nodes_per_rack: int
    racks: int
    afr_percent: float
    windows: tuple[tuple[int, float], ...]  # (gpus, days)

    @property
    def rack_mtbi_days(self) -> float:
        return rack_mtbi_days(self.node_mtbi_days, self.nodes_per_rack)

    @property
    def fleet_rack_interval_hours(self) -> float:
        return fleet_rack_interval_hours(self.node_mtbi_days, self.nodes_per_rack, self.racks)

    def failures(self) -> list[dict[str, Any]]:
        afr = self.afr_percent / 100.0
        return [{"gpus": g, "days": d, "expected_failures": expected_failures(g, d, afr),
                 "p_at_least_one": p_at_least_one_failure(g, d, afr)} for g, d in self.windows]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "node_mtbi_days": self.node_mtbi_days,
            "nodes_per_rack": self.nodes_per_rack,
            "racks": self.racks,
            "rack_mtbi_days": self.rack_mtbi_days,
            "fleet_rack_interval_hours": self.fleet_rack_interval_hours,
            "afr_percent": self.afr_percent,
            "failure_probability": self.failures(),
        }


def format_table(risk: Risk) -> str:
    n, r, m = risk.nodes_per_rack, risk.racks, risk.node_mtbi_days
    lines = [f"node MTBI {m:g} days, {n:,} nodes per rack, {r:,} racks",
             f"  one rack is interrupted every {risk.rack_mtbi_days:.1f} days ({m:g} / {n:,})",
             f"  some rack of the {r:,} every {risk.fleet_rack_interval_hours:.1f} hours "
             f"({m:g} / ({n:,} x {r:,}) days)",
             "",
             f"P(at least one GPU failure) at {risk.afr_percent:g} % per GPU per year"]
    rows = [(f"{f['gpus']:,}", f"{f['days']:g}", f"{f['expected_failures']:.2f}", f"{f['p_at_least_one']:.1%}")
            for f in risk.failures()]
    head = ("GPUs", "days", "expected failures", "P(>=1 failure)")
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(4)]
    lines.append("  " + "  ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    lines += ["  " + "  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """`gpuwarden plan risk`'s flags as given (agent/cli/plan.py parses them): checked here."""

    node_mtbi_days: str
    nodes_per_rack: str
    racks: str
    gpus: str
    days: str
    afr: str
    json: bool = False


def _list(text: str, flag: str) -> list[str]:
    items = split_list(text, flag)
    if len(items) > MAX_LIST:
        raise ConfigError(f"{flag}: {len(items)} values; at most {MAX_LIST}")
    return items


def parse(args: Options) -> Risk:
    mtbi = parse_float(args.node_mtbi_days, "--node-mtbi-days", 0.0, MAX_MTBI_DAYS, lo_open=True)
    nodes = parse_int(args.nodes_per_rack, "--nodes-per-rack", 1, MAX_NODES_PER_RACK)
    racks = parse_int(args.racks, "--racks", 1, MAX_RACKS)
    afr = parse_float(args.afr, "--afr", 0.0, 100.0, hi_open=True, unit="%")
    gpus = sorted({parse_int(g, "--gpus", 1, MAX_GPUS) for g in _list(args.gpus, "--gpus")})
    days = sorted({parse_float(d, "--days", 0.0, MAX_DAYS, lo_open=True) for d in _list(args.days, "--days")})
    windows: Sequence[tuple[int, float]] = [(g, d) for d in days for g in gpus]
    return Risk(mtbi, nodes, racks, afr, tuple(windows))


def run(args: Options) -> int:
    risk = parse(args)
    if args.json:
        print(json.dumps(risk.to_json(), indent=2))
    else:
        print(format_table(risk))
    return 0
