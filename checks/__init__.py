"""The checks. Each module holds one check's decision logic and exposes CHECK (a CheckSpec).

Order matters twice: it is the order of the report, and `gpuwarden analyze` asks the checks' analyzers in this
order which one reads a file (the kernel-log reader of `xid` is the fallback, asked last)."""
from __future__ import annotations

from gpuwarden.agent.check import CheckSpec
from gpuwarden.agent.passive import KernelConsumer, PassiveSpec, one_look

from . import (burnin, clock_events, dcgm_diag, ecc, ecc_memtest, ecc_watch, fabric, ib_downtime, ib_port,
               nccl_allreduce, nccl_sweep, nvlink_lanes, nvswitch_sxid, pcie_aer, pcie_link, peer_p2p, rdma_loopback,
               thermal, xid)

ALL: tuple[CheckSpec, ...] = (
    # quick: reads only, seconds. nvlink_lanes, fabric and pcie_aer are the daemon's checks, judged in one look
    # (agent/passive.py one_look), so a health check built on preflight sees what the daemon would at its first poll.
    xid.CHECK, nvswitch_sxid.CHECK, ecc.CHECK, ib_port.CHECK, pcie_link.CHECK,
    one_look(nvlink_lanes.SPEC), one_look(fabric.SPEC), one_look(pcie_aer.SPEC),
    # full: load the GPUs or the network, minutes
    burnin.CHECK, peer_p2p.CHECK, nccl_allreduce.CHECK, rdma_loopback.CHECK, dcgm_diag.CHECK, ecc_memtest.CHECK,
)


# gpuwarden run: polled passive checks, and the consumers of the followed kernel log.
PASSIVE: tuple[PassiveSpec, ...] = (
    ib_downtime.SPEC, clock_events.SPEC, thermal.SPEC, nvlink_lanes.SPEC, pcie_aer.SPEC, fabric.SPEC, ecc_watch.SPEC,
    nccl_sweep.SPEC,
)
KERNEL_CONSUMERS: tuple[KernelConsumer, ...] = (xid.CONSUMER, pcie_aer.KERNEL_CONSUMER, nvswitch_sxid.SXID_CONSUMER)


def all_specs() -> tuple[CheckSpec | PassiveSpec | KernelConsumer, ...]:
    """Every form of every check. A concern's forms share its name and so its one [checks.<name>] table: the
    preflight `xid`, the daemon's `xid` kernel-log consumer and `analyze` read the same keys (agent/config.py)."""
    return (*ALL, *PASSIVE, *KERNEL_CONSUMERS)


def by_name() -> dict[str, CheckSpec]:
    return {spec.name: spec for spec in ALL}


CONSUMER_BY_NAME: dict[str, KernelConsumer] = {c.name: c for c in KERNEL_CONSUMERS}
