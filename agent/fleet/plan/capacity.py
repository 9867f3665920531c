"""Fleet planning: how many nodes a rack-local slice size leaves usable as node unavailability grows.

A rack (one NVLink domain) of N nodes, each unavailable with probability p independently of the others, has
H ~ Binomial(N, 1 - p) healthy nodes and serves floor(H / S) slices of S nodes; R racks give
R * S * E[floor(H / S)] usable nodes. The expectation is summed exactly over the binomial, each term in log space
so that racks of thousands of nodes stay finite. On 128 racks of 18 nodes at 2 % this gives the published
figures: 8-node slices 2,043 usable nodes, 9-node 1,953, 16-node 2,037, 18-node 1,602 (nearest node).
"""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any, Sequence

from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.flag_values import parse_float, parse_int, shown, split_list
from gpuwarden.agent.core.records import dataclass

MAX_RACKS = 1_000_000
MAX_NODES_PER_RACK = 10_000
MAX_SLICE_SIZES = 64
MAX_POINTS = 1_001
# Each point costs a pass over the rack's binomial (N + 1 terms); this many terms in all is about a second or two,
# so a 10,000-node rack takes up to 199 points, an 18-node rack the full MAX_POINTS.
MAX_TERMS = 2_000_000
DEFAULT_STEP = 1.0  # percentage points between the values of "A..B"

JSON_VERSION = 1


def parse_slices(text: str, nodes_per_rack: int, flag: str = "--slice") -> tuple[int, ...]:
    """Slice sizes 'S[,S…]', each in [1, nodes per rack]; ascending, without repeats."""
    items = split_list(text, flag)
    if len(items) > MAX_SLICE_SIZES:
        raise ConfigError(f"{flag}: {len(items)} slice sizes; at most {MAX_SLICE_SIZES}")
    sizes = {parse_int(i, flag, 1, MAX_NODES_PER_RACK) for i in items}
    too_big = sorted(s for s in sizes if s > nodes_per_rack)
    if too_big:
        raise ConfigError(f"{flag} {too_big[0]}: larger than --nodes-per-rack {nodes_per_rack}; a slice is placed "
                          "within one rack")
    return tuple(sorted(sizes))


def parse_unavailable(text: str, flag: str = "--unavailable") -> tuple[float, ...]:
    """Unavailability in percent: a comma list of values 'P' and ranges 'A..B' (every DEFAULT_STEP points from A
    through B) or 'A..B:STEP'; each value in [0, 100). Ascending, without repeats, at most MAX_POINTS values."""
    points: set[float] = set()
    for item in split_list(text, flag):
        lo_text, dots, rest = item.partition("..")
        if not dots:
            points.add(parse_float(item, flag, 0.0, 100.0, hi_open=True, unit="%"))
        else:
            hi_text, colon, step_text = rest.partition(":")
            lo = parse_float(lo_text, flag, 0.0, 100.0, hi_open=True, unit="%")
            hi = parse_float(hi_text, flag, 0.0, 100.0, hi_open=True, unit="%")
            step = parse_float(step_text, f"{flag} step", 0.0, 100.0, lo_open=True) if colon else DEFAULT_STEP
            if hi < lo:
                raise ConfigError(f"{flag} {shown(item)}: the range ends below where it starts")
            # Counted before any is made, so a step of 1e-9 is refused rather than looped over (and one of 5e-324,
            # whose count is infinite, before floor() sees it).
            span = (hi - lo) / step
            if span >= MAX_POINTS or math.floor(span + 1e-9) + 1 + len(points) > MAX_POINTS:
                raise ConfigError(f"{flag} {shown(item)}: more than {MAX_POINTS:,} values; use a larger step")
            # round(): 0.1 * 3 is 0.30000000000000004; the table and the JSON show the value that was meant.
            points.update(min(round(lo + i * step, 9), hi) for i in range(math.floor(span + 1e-9) + 1))
        if len(points) > MAX_POINTS:
            raise ConfigError(f"{flag}: more than {MAX_POINTS:,} values")
    return tuple(sorted(points))


# -- the model (pure) ---------------------------------------------------------------------------------------------
def log_binomial_coefficients(nodes: int) -> list[float]:
    """log C(nodes, h) for h = 0..nodes (computed once per rack size, shared by every unavailability)."""
    lg_n = math.lgamma(nodes + 1)
    return [lg_n - math.lgamma(h + 1) - math.lgamma(nodes - h + 1) for h in range(nodes + 1)]


def healthy_distribution(nodes: int, p: float, log_comb: Sequence[float] | None = None) -> list[float]:
    """P(H = h) for h = 0..nodes: H ~ Binomial(nodes, 1 - p), p the unavailability as a fraction in [0, 1)."""
    if nodes < 0 or not 0.0 <= p < 1.0:
        raise ValueError(f"nodes {nodes}, p {p}: need nodes >= 0 and 0 <= p < 1")
    if p == 0.0:
        return [0.0] * nodes + [1.0]
    if log_comb is None:
        log_comb = log_binomial_coefficients(nodes)
    log_q, log_p = math.log1p(-p), math.log(p)
    logs = [c + h * log_q + (nodes - h) * log_p for h, c in enumerate(log_comb)]
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    # The terms sum to 1 up to lgamma's rounding; dividing by their sum removes that drift.
    total = math.fsum(weights)
    return [w / total for w in weights]


def tail_probabilities(distribution: Sequence[float]) -> list[float]:
    """P(H >= h) for h = 0..nodes + 1, from P(H = h)."""
    tail = [0.0] * (len(distribution) + 1)
    for h in range(len(distribution) - 1, -1, -1):
        tail[h] = tail[h + 1] + distribution[h]
    return tail


def expected_slices(tail: Sequence[float], slice_nodes: int) -> float:
    """E[floor(H / S)], the slices of S nodes one rack serves on average, as the sum over k >= 1 of P(H >= k S):
    N / S terms per slice size instead of N."""
    return math.fsum(tail[k] for k in range(slice_nodes, len(tail) - 1, slice_nodes))


def usable_nodes(racks: int, nodes_per_rack: int, slice_nodes: int, unavailable_percent: float) -> float:
    """Expected usable nodes of `racks` racks: racks * S * E[floor(H / S)]."""
    tail = tail_probabilities(healthy_distribution(nodes_per_rack, unavailable_percent / 100.0))
    return racks * slice_nodes * expected_slices(tail, slice_nodes)


def round_nodes(value: float) -> int:
    """To the nearest node, halves up (the published figures are rounded this way)."""
    return math.floor(value + 0.5)


@dataclass(frozen=True)
class Capacity:
    racks: int
    nodes_per_rack: int
    slices: tuple[int, ...]
    unavailable_percent: tuple[float, ...]
    usable: dict[int, tuple[float, ...]]  # slice size -> expected usable nodes, one per unavailable_percent

    @property
    def fleet_nodes(self) -> int:
        return self.racks * self.nodes_per_rack

    def share(self, slice_nodes: int) -> tuple[float, ...]:
        return tuple(u / self.fleet_nodes for u in self.usable[slice_nodes])

    def to_json(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "model": "binomial",
            "racks": self.racks,
            "nodes_per_rack": self.nodes_per_rack,
            "fleet_nodes": self.fleet_nodes,
            "unavailable_percent": list(self.unavailable_percent),
            "slices": [{"slice_nodes": s,
                        "usable_nodes": list(self.usable[s]),
                        "usable_nodes_rounded": [round_nodes(u) for u in self.usable[s]],
                        "share_of_fleet": list(self.share(s))} for s in self.slices],
        }


def capacity(racks: int, nodes_per_rack: int, slices: Sequence[int], unavailable_percent: Sequence[float]) -> Capacity:
    """Expected usable nodes for every slice size at every unavailability (percent)."""
    usable: dict[int, list[float]] = {s: [] for s in slices}
    log_comb = log_binomial_coefficients(nodes_per_rack)
    for pct in unavailable_percent:
        tail = tail_probabilities(healthy_distribution(nodes_per_rack, pct / 100.0, log_comb))
        for s in slices:
            usable[s].append(racks * s * expected_slices(tail, s))
    return Capacity(racks, nodes_per_rack, tuple(slices), tuple(unavailable_percent),
                    {s: tuple(v) for s, v in usable.items()})


def monte_carlo_usable_per_rack(nodes_per_rack: int, slice_nodes: int, unavailable_percent: float, trials: int,
                                seed: int) -> tuple[float, float]:
    """Brute force: draws `trials` racks node by node (each down with probability p) and counts the nodes in whole
    slices. Returns (mean usable nodes per rack, its standard error). Seeded: the same arguments give the same
    answer. An independent check of the exact sum, not used by the command."""
    rng = random.Random(seed)
    p = unavailable_percent / 100.0
    total = total_sq = 0.0
    for _ in range(trials):
        healthy = sum(1 for _ in range(nodes_per_rack) if rng.random() >= p)
        used = (healthy // slice_nodes) * slice_nodes
        total += used
        total_sq += used * used
    mean = total / trials
    var = max(total_sq / trials - mean * mean, 0.0) * trials / max(trials - 1, 1)
    return mean, math.sqrt(var / trials)


# -- output -------------------------------------------------------------------------------------------------------
def format_table(result: Capacity) -> str:
    head = (f"{result.racks:,} racks x {result.nodes_per_rack:,} nodes = {result.fleet_nodes:,} nodes; "
            "expected usable nodes (share of the fleet) by slice size")
    cells = {s: [f"{round_nodes(u):,} ({u / result.fleet_nodes:.1%})" for u in result.usable[s]]
             for s in result.slices}
    widths = {s: max(len(f"{s}-node slices"), *(len(c) for c in cells[s])) for s in result.slices}
    pct = [f"{p:g}%" for p in result.unavailable_percent]
    w0 = max(len("unavailable"), *(len(p) for p in pct))
    lines = [head, "  ".join([f"{'unavailable':>{w0}}"] + [f"{f'{s}-node slices':>{widths[s]}}"
                                                          for s in result.slices])]
    for i, p in enumerate(pct):
        lines.append("  ".join([f"{p:>{w0}}"] + [f"{cells[s][i]:>{widths[s]}}" for s in result.slices]))
    return "\n".join(lines)


def draw_capacity(result: Capacity) -> Any:
    """The figure: expected usable nodes vs unavailability, one line per slice size (matplotlib, Agg)."""
    try:  # optional dependency: matplotlib, the `plot` extra, for --plot only
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: install the 'plot' extra "
                          "(pip install 'gpuwarden[plot]')") from None
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)  # no pyplot: no global state, no display needed
    ax = fig.add_subplot(1, 1, 1)
    x = list(result.unavailable_percent)
    for s in result.slices:
        ax.plot(x, list(result.usable[s]), marker="o" if len(x) <= 25 else None, markersize=3,
                label=f"{s}-node slices")
    fleet = result.fleet_nodes
    ax.set_title(f"Usable nodes vs node unavailability: {result.racks:,} racks x {result.nodes_per_rack:,} nodes "
                 f"({fleet:,} nodes)")
    ax.set_xlabel("node unavailability (%)")
    ax.set_ylabel("expected usable nodes")
    share = ax.secondary_yaxis("right", functions=(lambda n: n / fleet * 100.0, lambda s: s * fleet / 100.0))
    share.set_ylabel("share of the fleet (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(title="rack-local slices")
    fig.tight_layout()
    return fig


def write_plot(result: Capacity, path: Path) -> None:
    fig = draw_capacity(result)
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise ConfigError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None


# -- the command --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """`gpuwarden plan capacity`'s flags as given (agent/cli/plan.py parses them): checked here."""

    racks: str
    nodes_per_rack: str
    slice: str
    unavailable: str
    json: bool = False
    plot: Path | str | None = None


def run(args: Options) -> int:
    racks = parse_int(args.racks, "--racks", 1, MAX_RACKS)
    nodes = parse_int(args.nodes_per_rack, "--nodes-per-rack", 1, MAX_NODES_PER_RACK)
    slices = parse_slices(args.slice, nodes)
    points = parse_unavailable(args.unavailable)
    if len(points) * (nodes + 1) > MAX_TERMS:
        raise ConfigError(f"--unavailable: {len(points):,} values for racks of {nodes:,} nodes; at most "
                          f"{MAX_TERMS // (nodes + 1):,} at that rack size (use a larger step)")
    result = capacity(racks, nodes, slices, points)
    if args.plot:
        write_plot(result, Path(args.plot))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_table(result))
    if args.plot:
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
