"""The checks. Each module holds one check's decision logic and exposes CHECK (a CheckSpec).

Order matters twice: it is the order of the report, and `gpuwarden analyze` asks the checks' analyzers in this
order which one reads a file (the kernel-log reader of `xid` is the fallback, asked last).

A module is imported when one of its forms is used: a quick preflight loads the quick checks (and the tables its
config file sets), not the burn-in, NCCL, RDMA or DCGM code it does not run. CONCERNS says which modules hold which
concern's forms without importing them (tests/test_checks_registry.py holds it to the modules); ALL, PASSIVE,
KERNEL_CONSUMERS and the modules themselves load on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from gpuwarden.agent.core.check import CheckSpec
    from gpuwarden.agent.core.passive import KernelConsumer, PassiveSpec

# Every concern in the order of the report: its name (its [checks.<name>] table), the level of its preflight form
# (None: the daemon's only), and the modules holding its forms, the preflight form's first (a CHECK, else the
# daemon's SPEC judged in one look).
CONCERNS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    # quick: reads only, seconds. nvlink_lanes, fabric and pcie_aer are the daemon's checks, judged in one look
    # (agent/core/passive.py one_look), so a health check built on preflight sees what the daemon would at its first
    # poll.
    ("xid", "quick", ("xid",)),
    ("nvswitch_sxid", "quick", ("nvswitch_sxid",)),
    ("ecc", "quick", ("ecc", "ecc_watch")),
    ("ib_port", "quick", ("ib_port", "ib_downtime")),
    ("pcie_link", "quick", ("pcie_link",)),
    ("nvlink_lanes", "quick", ("nvlink_lanes",)),
    ("fabric", "quick", ("fabric",)),
    ("pcie_aer", "quick", ("pcie_aer",)),
    ("jobs", "quick", ("jobs",)),
    # full: load the GPUs or the network, minutes
    ("burnin", "full", ("burnin",)),
    ("peer_p2p", "full", ("peer_p2p",)),
    ("nccl_allreduce", "full", ("nccl_allreduce",)),
    ("rdma_loopback", "full", ("rdma_loopback",)),
    ("dcgm_diag", "full", ("dcgm_diag",)),
    ("ecc_memtest", "full", ("ecc_memtest",)),
    # the daemon's only
    ("clock_events", None, ("clock_events",)),
    ("thermal", None, ("thermal",)),
    ("nccl_sweep", None, ("nccl_sweep",)),
)
NAMES: tuple[str, ...] = tuple(name for name, _, _ in CONCERNS)  # every [checks.<name>] table
PREFLIGHT_NAMES: tuple[str, ...] = tuple(name for name, level, _ in CONCERNS if level)
_MODULES = {name: modules for name, _, modules in CONCERNS}
_FORM_ATTRS = ("CHECK", "SPEC", "CONSUMER", "KERNEL_CONSUMER", "SXID_CONSUMER")  # where a module keeps its forms

# gpuwarden run: polled passive checks, and the consumers of the followed kernel log, as (module, attribute).
_PASSIVE = (("ib_downtime", "SPEC"), ("clock_events", "SPEC"), ("thermal", "SPEC"), ("nvlink_lanes", "SPEC"),
            ("pcie_aer", "SPEC"), ("fabric", "SPEC"), ("ecc_watch", "SPEC"), ("nccl_sweep", "SPEC"), ("jobs", "SPEC"))
_KERNEL_CONSUMERS = (("xid", "CONSUMER"), ("pcie_aer", "KERNEL_CONSUMER"), ("nvswitch_sxid", "SXID_CONSUMER"))
_SUBMODULES = frozenset(m for _, _, modules in CONCERNS for m in modules) | {
    "fabric_manager", "parse_dcgmi_diag", "parse_limits", "parse_nccl_tests", "parse_nvbandwidth",
    "parse_nvidia_smi_topo", "parse_perftest", "unread_lines", "xid_catalog", "xid_log"}
_preflight_forms: dict[str, CheckSpec] = {}


def _module(name: str) -> Any:
    return importlib.import_module(f"{__name__}.{name}")


def preflight_form(name: str) -> CheckSpec:
    """The preflight form of a concern (KeyError: it has none), importing its modules only."""
    spec = _preflight_forms.get(name)
    if spec is None:
        module = _module(_MODULES[name][0])
        if hasattr(module, "CHECK"):
            spec = module.CHECK
        else:
            from gpuwarden.agent.core.passive import one_look

            spec = one_look(module.SPEC)
        if spec.name != name or name not in PREFLIGHT_NAMES:
            raise KeyError(name)
        spec = _preflight_forms.setdefault(name, spec)
    return spec


def chosen(names: Sequence[str], level: str) -> list[CheckSpec]:
    """What a preflight runs: the checks named, whatever their level, in the order named; else every check of the
    level (quick, or full: quick and full) in the order of the report. ValueError names an unknown check."""
    unknown = [n for n in names if n not in PREFLIGHT_NAMES]
    if unknown:
        raise ValueError(f"unknown check '{unknown[0]}' (known: {', '.join(PREFLIGHT_NAMES)})")
    if not names:
        names = [n for n, lvl, _ in CONCERNS if lvl == "quick" or (lvl and level == "full")]
    return [preflight_form(n) for n in names]


def forms(names: Iterable[str]) -> list[CheckSpec | PassiveSpec | KernelConsumer]:
    """Every form of the named concerns, and of the concerns whose keys they read (shared_keys): what the config
    needs to know their tables. Only their modules are imported. KeyError for a name that is not a concern."""
    out: list[Any] = []
    todo, done = list(names), set()
    while todo:
        name = todo.pop(0)
        if name in done:
            continue
        done.add(name)
        for module in _MODULES[name]:
            mod = _module(module)
            for attr in _FORM_ATTRS:
                spec = getattr(mod, attr, None)
                if spec is not None and spec.name == name and all(spec is not s for s in out):
                    out.append(spec)
        if name in PREFLIGHT_NAMES:
            spec = preflight_form(name)
            if all(spec is not s for s in out):
                out.append(spec)
        todo.extend(owner for s in out for owner in (getattr(s, "shared_keys", None) or {}).values())
    return out


def all_specs() -> tuple[CheckSpec | PassiveSpec | KernelConsumer, ...]:
    """Every form of every check. A concern's forms share its name and so its one [checks.<name>] table: the
    preflight `xid`, the daemon's `xid` kernel-log consumer and `analyze` read the same keys (agent/core/config.py)."""
    return (*_table("ALL"), *_table("PASSIVE"), *_table("KERNEL_CONSUMERS"))


def by_name() -> dict[str, CheckSpec]:
    return {spec.name: spec for spec in _table("ALL")}


def _table(name: str) -> Any:
    # A name in globals() wins: one a test replaced, or one built already.
    return globals()[name] if name in globals() else __getattr__(name)


def __getattr__(name: str) -> Any:
    # The full tables, built on first use and then kept as plain attributes (so a test may replace them).
    if name == "ALL":
        value: Any = tuple(preflight_form(n) for n in PREFLIGHT_NAMES)
    elif name == "PASSIVE":
        value = tuple(getattr(_module(m), attr) for m, attr in _PASSIVE)
    elif name == "KERNEL_CONSUMERS":
        value = tuple(getattr(_module(m), attr) for m, attr in _KERNEL_CONSUMERS)
    elif name == "CONSUMER_BY_NAME":
        value = {c.name: c for c in _table("KERNEL_CONSUMERS")}
    elif name in _SUBMODULES:
        return _module(name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
