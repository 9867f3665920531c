"""The checks. Each module holds one check's decision logic and exposes CHECK (a CheckSpec).

Order matters twice: it is the order of the report, and `gpuwarden analyze` asks the checks' analyzers in this
order which one reads a file (the kernel-log reader of `xid` is the fallback, asked last).

The tables below are built on first use (PEP 562), so importing one check (`from gpuwarden.checks import xid`, as
`gpuwarden analyze` does for a kernel log) does not import every other check and what they import."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from gpuwarden.agent.check import CheckSpec
    from gpuwarden.agent.passive import KernelConsumer, PassiveSpec

    ALL: tuple[CheckSpec, ...]
    PASSIVE: tuple[PassiveSpec, ...]
    KERNEL_CONSUMERS: tuple[KernelConsumer, ...]
    CONSUMER_BY_NAME: dict[str, KernelConsumer]

_TABLES = ("ALL", "PASSIVE", "KERNEL_CONSUMERS", "CONSUMER_BY_NAME")
_MODULES = frozenset(("burnin", "clock_events", "dcgm_diag", "ecc", "ecc_memtest", "ecc_watch", "fabric",
                      "ib_downtime", "ib_port", "nccl_allreduce", "nccl_sweep", "nvlink_lanes", "nvswitch_sxid",
                      "pcie_aer", "pcie_link", "peer_p2p", "rdma_loopback", "thermal", "xid"))


def _tables() -> dict[str, Any]:
    from gpuwarden.agent.passive import one_look

    from . import (burnin, clock_events, dcgm_diag, ecc, ecc_memtest, ecc_watch, fabric, ib_downtime, ib_port,
                   nccl_allreduce, nccl_sweep, nvlink_lanes, nvswitch_sxid, pcie_aer, pcie_link, peer_p2p,
                   rdma_loopback, thermal, xid)

    all_checks = (
        # quick: reads only, seconds. nvlink_lanes, fabric and pcie_aer are the daemon's checks, judged in one look
        # (agent/passive.py one_look), so a health check built on preflight sees what the daemon would at its first
        # poll.
        xid.CHECK, nvswitch_sxid.CHECK, ecc.CHECK, ib_port.CHECK, pcie_link.CHECK,
        one_look(nvlink_lanes.SPEC), one_look(fabric.SPEC), one_look(pcie_aer.SPEC),
        # full: load the GPUs or the network, minutes
        burnin.CHECK, peer_p2p.CHECK, nccl_allreduce.CHECK, rdma_loopback.CHECK, dcgm_diag.CHECK, ecc_memtest.CHECK,
    )
    # gpuwarden run: polled passive checks, and the consumers of the followed kernel log.
    passive = (ib_downtime.SPEC, clock_events.SPEC, thermal.SPEC, nvlink_lanes.SPEC, pcie_aer.SPEC, fabric.SPEC,
               ecc_watch.SPEC, nccl_sweep.SPEC)
    consumers = (xid.CONSUMER, pcie_aer.KERNEL_CONSUMER, nvswitch_sxid.SXID_CONSUMER)
    return {"ALL": all_checks, "PASSIVE": passive, "KERNEL_CONSUMERS": consumers,
            "CONSUMER_BY_NAME": {c.name: c for c in consumers}}


def _loaded() -> dict[str, Any]:
    """The module's globals, the tables among them (a test may have replaced one: it is kept)."""
    if "ALL" not in globals():
        globals().update(_tables())
    return globals()


def __getattr__(name: str) -> Any:
    if name in _TABLES:
        return _loaded()[name]
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def all_specs() -> tuple[CheckSpec | PassiveSpec | KernelConsumer, ...]:
    """Every form of every check. A concern's forms share its name and so its one [checks.<name>] table: the
    preflight `xid`, the daemon's `xid` kernel-log consumer and `analyze` read the same keys (agent/config.py)."""
    t = _loaded()
    return (*t["ALL"], *t["PASSIVE"], *t["KERNEL_CONSUMERS"])


def by_name() -> dict[str, CheckSpec]:
    return {spec.name: spec for spec in _loaded()["ALL"]}
