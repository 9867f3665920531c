"""The [sweep] criteria's settings: their defaults with why each is what it is, their ranges, and the reading of
[sweep.baselines]. The config loader checks them when it reads a file (a bad value stops a sweep before any
collective runs); agent/fleet/sweep/criteria.py judges a group's run by them."""
from __future__ import annotations

from typing import Any, Mapping

from gpuwarden.agent.core.errors import ConfigError

TABLE = "nccl_sweep"  # checks/data/thresholds/nccl_sweep.toml
TABLE_SOURCE = f"thresholds/{TABLE}.toml"
CONFIG_SOURCE = "config [sweep.baselines]"
BASELINES_KEY = "baselines"  # [sweep.baselines]: "<SKU>/<nodes>" = { latency_p95_us = .., busbw_gbps = .. }

CRITERIA_DEFAULTS: dict[str, Any] = {
    # Sizes up to this many bytes are latency-bound (NCCL runs them with the LL/LL128 protocols): judged on the
    # p95 of their time over the run's cycles.
    "small_max_bytes": 65536,
    # Sizes from this many bytes up are bandwidth-bound: judged on bus bandwidth at the largest such size. The
    # sizes between small_max_bytes and this (where NCCL moves from tree to ring) are reported, never judged.
    "large_min_bytes": 1073741824,
    # SLOW when the group's small-message latency is above this many times its baseline. The two halves of one
    # row of a healthy 2 x H100 run differ by up to 1.30x (65536 B: 135.1 vs 103.8 us, thresholds/nccl_sweep.toml)
    # so anything under 1.5 would flap on healthy groups.
    "latency_factor": 1.5,
    # SLOW when the group's bus bandwidth is under this fraction of its baseline. Healthy 2 x H100 runs at 2 GiB
    # agree within 1.3 % (437.89 vs 443.72 GB/s); 0.8 flags a lost NIC rail or a link running at a lower rate
    # without tripping on run-to-run noise.
    "busbw_fraction": 0.8,
    # Cycles (all_reduce_perf -N) needed for a p95: with fewer, each size's figure is the median over the cycles
    # there are (a median judged against a p95 baseline can only be lenient, never fail a healthy group).
    "min_cycles": 5,
    # Past figures a node needs at a group size before they make a learned baseline (sweep history).
    "history_min_samples": 5,
    # Past figures kept per node and group size in the sweep history (the oldest go first).
    "history_keep": 50,
}

# The range each [sweep] key above may take (inclusive); check_policy() enforces them, and the small range must
# end below the large one.
CRITERIA_RANGES: dict[str, tuple[float, float]] = {
    "small_max_bytes": (1, 1 << 40),
    "large_min_bytes": (2, 1 << 40),
    "latency_factor": (1.0, 100.0),  # under 1 a group at its own baseline would be slow
    "busbw_fraction": (0.01, 1.0),  # over 1 likewise
    "min_cycles": (2, 10_000),  # one cycle has no spread to take a p95 of
    "history_min_samples": (1, 10_000),
    "history_keep": (1, 10_000),
}

_MAX_ENTRIES = 1000  # [sweep.baselines] entries: far past any fleet's SKU x group-size combinations
_MAX_NODES = 100_000
BASELINE_FIELDS = {  # field -> (unit, largest value taken)
    "latency_p95_us": ("us", 1e7),  # 10 s for one small all-reduce is no baseline, it is a hang
    "busbw_gbps": ("GB/s", 1e5),  # 100 TB/s per GPU is far past any fabric
}
_SKU_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")

def check_policy(policy: Mapping[str, Any], origin: str = "[sweep]") -> dict[str, Any]:
    """The criteria's keys of `policy`, defaults filled in, each checked against CRITERIA_RANGES (a ConfigError
    naming the key). Call it when the config is read, so a bad value stops the sweep before any collective runs."""
    p = {**CRITERIA_DEFAULTS, **{k: v for k, v in policy.items() if k in CRITERIA_DEFAULTS}}
    for key, (low, high) in CRITERIA_RANGES.items():
        value = p[key]
        whole = isinstance(CRITERIA_DEFAULTS[key], int)
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
                or not low <= value <= high:
            raise ConfigError(f"{origin} {key}: must be {'an integer' if whole else 'a number'} from {low:g} to "
                              f"{high:g}, got {_quoted(value)}")
    if p["small_max_bytes"] >= p["large_min_bytes"]:
        raise ConfigError(f"{origin} small_max_bytes ({p['small_max_bytes']}) must be below large_min_bytes "
                          f"({p['large_min_bytes']})")
    return p


# -- baselines --------------------------------------------------------------------------------------------------------
def parse_baselines(table: Any, source: str) -> dict[tuple[str, int], dict[str, float]]:
    """[sweep.baselines] (or the bundled table): {"<SKU>/<nodes>": {latency_p95_us, busbw_gbps}} ->
    {(sku, nodes): {field: value}}. Everything is checked; the first fault is a ConfigError naming its key."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: must be a table of \"<SKU>/<nodes>\" = "
                          f"{{ latency_p95_us = .., busbw_gbps = .. }}")
    if len(table) > _MAX_ENTRIES:
        raise ConfigError(f"{source}: {len(table)} entries, at most {_MAX_ENTRIES}")
    out: dict[tuple[str, int], dict[str, float]] = {}
    for key, value in table.items():
        shown = repr(key)[:80]
        sku, nodes = _baseline_key(key, source)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source} {shown}: must be a table {{ latency_p95_us = .., busbw_gbps = .. }}")
        unknown = [k for k in value if k not in BASELINE_FIELDS]
        if unknown:
            raise ConfigError(f"{source} {shown}: unknown key {repr(unknown[0])[:80]} "
                              f"(known: {', '.join(BASELINE_FIELDS)})")
        if not value:
            raise ConfigError(f"{source} {shown}: sets neither {' nor '.join(BASELINE_FIELDS)}")
        figures = {}
        for name, number in value.items():
            top = BASELINE_FIELDS[name][1]
            # Compared, never converted first: nan fails every comparison, inf and a 400-digit int fail the bound.
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number <= top:
                raise ConfigError(f"{source} {shown}.{name}: must be a number > 0 and <= {top:g}, "
                                  f"got {_quoted(number)}")
            figures[name] = float(number)
        out[(sku, nodes)] = figures
    return out


def _quoted(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 30:
        return f"a number of {len(str(abs(value))) if value.bit_length() < 10_000 else 'thousands of'} digits"
    return repr(value)[:40] if not isinstance(value, (str, bytes, list, dict)) or len(value) < 1000 else \
        f"{type(value).__name__} of {len(value)} items"


def _baseline_key(key: Any, source: str) -> tuple[str, int]:
    shown = repr(key)[:80]
    if not isinstance(key, str) or len(key) > 80 or key.count("/") != 1:
        raise ConfigError(f"{source}: key {shown} must be \"<SKU>/<nodes>\", e.g. \"H100-SXM-HGX/2\"")
    sku, nodes = key.split("/")
    if not sku or not set(sku) <= _SKU_CHARS:
        raise ConfigError(f"{source}: key {shown}: the SKU must be letters, digits, '.', '_' or '-'")
    if not nodes.isascii() or not nodes.isdigit() or nodes.startswith("0") or len(nodes) > 6 \
            or not 2 <= int(nodes) <= _MAX_NODES:
        raise ConfigError(f"{source}: key {shown}: the node count must be a whole number from 2 to {_MAX_NODES}")
    return sku, int(nodes)
