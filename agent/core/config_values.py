"""The values a config may hold: the bounds on sizes, the range of every number (`_RANGES` lists the keys whose range
is not their type's default), the settings with a fixed set of values, and `coerce`, which checks one value against
them and names the key and the file when it is wrong (agent/core/config.py reads the file).
"""
from __future__ import annotations

import math
from typing import Any

from gpuwarden.agent.core.errors import ConfigError

# The signals `[jobs] signal` may name (scancel --signal takes the name without SIG).
SIGNAL_NAMES: tuple[str, ...] = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "CONT", "ALRM", "KILL")
_CHOICES: dict[str, tuple[Any, ...]] = {"agent.log_format": ("auto", "json", "console"),
                                        "agent.log_level": ("debug", "info", "warning", "error"),
                                        "agent.level": ("quick", "full"),
                                        "remediation.mode": ("dry-run", "act"),
                                        "remediation.adapter": ("local", "slurm", "kubernetes"),
                                        "jobs.on_doomed": ("notify", "signal", "requeue", "cancel"),
                                        "jobs.signal": SIGNAL_NAMES,
                                        "sweep.launcher": ("auto", "srun", "mpirun"),
                                        "sweep.link_action": ("drain", "monitor")}

MAX_FILE_BYTES = 1 << 20
MAX_STR = 4096  # characters in one string value
MAX_LIST = 4096  # items in one list value
INT_MAX = 2**53  # above any count, size or seed the checks use, and exact as a float
FLOAT_MAX = 1e12  # above any threshold the checks use (GB/s, TFLOP/s, errors per minute, degrees)
TIMEOUT_MAX_S = 86400.0  # a timeout or a budget: one day
DURATION_MAX_S = 366 * 86400.0  # any other *_s key (windows, hold times): one year
# Keys whose range is not the default of their type above: (lowest, highest), both inclusive.
_RANGES: dict[str, tuple[float, float]] = {
    "checks.rdma_loopback.roce_gid_index": (-1, 65535),  # -1 = perftest's own default GID (no -x)
    "checks.burnin.relative_drop": (0.0, 1.0),
    "checks.rdma_loopback.min_fraction": (0.0, 1.0),
    "checks.clock_events.hw_fail_ratio": (0.0, 1.0),
    "checks.clock_events.hw_warn_ratio": (0.0, 1.0),
    "checks.clock_events.sw_thermal_warn_ratio": (0.0, 1.0),
    "remediation.breaker.cluster_share": (0.0, 1.0),
    "remediation.breaker.domain_share": (0.0, 1.0),
    # (the [sweep] criteria's own ranges are agent/core/sweep_policy.py CRITERIA_RANGES, checked by apply())
    "sweep.group_nodes": (2, 100_000),
    "sweep.ranks_per_node": (1, 1024),
    "sweep.max_tests": (0, 100_000),
}




def bounds(key: str, default: Any) -> tuple[float, float]:
    """The range a number under `key` must lie in (`default` gives its type)."""
    if key in _RANGES:
        return _RANGES[key]
    short = key.rsplit(".", 1)[-1]
    if short.endswith("_s"):
        timeout = "timeout" in short or short == "budget_s" or isinstance(default, int)
        return 0, TIMEOUT_MAX_S if timeout else DURATION_MAX_S
    return (0, INT_MAX) if isinstance(default, int) else (0.0, FLOAT_MAX)


def coerce(key: str, value: Any, default: Any, origin: str, item_type: type | None = None,
           choices: tuple[Any, ...] | None = None, name: str | None = None) -> Any:
    """Check `value` has the type of `default` (int is accepted where a float is expected), lies in the key's
    range and, with `choices`, is one of them. `name`: how the error names the value (default: the key)."""
    def bad(expected: str) -> ConfigError:
        shown = repr(value) if not isinstance(value, (str, list)) or len(value) <= 80 else \
            f"{type(value).__name__} of length {len(value)}"
        return ConfigError(f"{origin}: '{name or key}' must be {expected}, got {shown}")

    def in_range(number: int | float) -> None:
        low, high = bounds(key, default)
        if not math.isfinite(number) or not low <= number <= high:
            raise bad(f"a number from {low:g} to {high:g}")

    if choices is None:
        choices = _CHOICES.get(key)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        if choices is None:
            in_range(value)
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        if isinstance(value, int) and abs(value) > INT_MAX:
            raise bad(f"a number from {bounds(key, default)[0]:g} to {bounds(key, default)[1]:g}")
        value = float(value)
        in_range(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise bad("a string")
        if len(value) > MAX_STR:
            raise bad(f"a string of at most {MAX_STR} characters")
    elif isinstance(default, list):
        if not isinstance(value, list):
            raise bad("a list")
        if len(value) > MAX_LIST:
            raise bad(f"a list of at most {MAX_LIST} items")
        kind = item_type or (type(default[0]) if default else None)
        if kind is not None and any(not isinstance(v, kind) or isinstance(v, bool) != (kind is bool) for v in value):
            raise bad(f"a list of {kind.__name__}")
        if any(isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= INT_MAX for v in value):
            raise bad(f"a list of integers from 0 to {INT_MAX}")
        if any(isinstance(v, str) and len(v) > MAX_STR for v in value):
            raise bad(f"a list of strings of at most {MAX_STR} characters")
    if choices is not None and value not in choices:
        raise bad("one of " + ", ".join(repr(c) if isinstance(c, str) and not c else str(c) for c in choices))
    return value
