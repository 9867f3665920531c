"""InfiniBand / RoCE port state now, from sysfs: a port that should be up is down, or runs below the rate
it should. (Cumulative downtime over time is the daemon's job.)"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import NotApplicable, SourceError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.records import dataclass

CHECK_NAME = "ib_port"
IB_CLASS = "/sys/class/infiniband"
# What the kernel prints in ports/<n>/state ("%d: %s", drivers/infiniband/core/sysfs.c state_show), by number; it
# prints "UNKNOWN" for a number outside this table.
PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
# ports/<n>/rate ("%d%s Gb/sec (%dX %s)", rate_show): bounded digits, so a number is finite and the match linear.
_RATE = re.compile(r"\s*(\d{1,6}(?:\.\d{1,3})?) Gb/sec(?: \(|$)")


@dataclass(frozen=True)
class PortReading:
    port: str  # "mlx5_2/1"
    pci: str | None
    state: str  # "ACTIVE", "DOWN", ... (sysfs prints "4: ACTIVE")
    phys_state: str  # "LinkUp", "Polling", "Disabled", ...
    rate_gbps: float | None
    link_layer: str  # InfiniBand | Ethernet
    link_downed: int | None


def _after_colon(text: str) -> str:
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def parse_rate(text: str) -> float | None:
    """"400 Gb/sec (4X NDR)" -> 400.0; None for anything else (the port's rate is then not known)."""
    m = _RATE.match(text)
    return float(m.group(1)) if m else None


def parse_state(text: str) -> str | None:
    """"4: ACTIVE" -> "ACTIVE" (a bare name, as some captures hold, too); None for what is not a port state: empty,
    garbage, a number that disagrees with its name, or the kernel's own "UNKNOWN"."""
    number, sep, name = text.strip().partition(":")
    if not sep:
        return number if number in PORT_STATES else None
    name = name.strip()
    if name not in PORT_STATES or not (number.isascii() and number.isdigit() and len(number) <= 3):
        return None
    return name if int(number) < len(PORT_STATES) and PORT_STATES[int(number)] == name else None


def expected_rates(ports: Iterable[PortReading], configured: float) -> dict[str, float]:
    """Expected Gb/s per link layer: the configured figure, else the fastest active port of that layer
    (a node's rails are built alike, so one slower rail is the odd one out)."""
    out: dict[str, float] = {}
    for p in ports:
        if configured > 0:
            out[p.link_layer] = configured
        elif p.state == "ACTIVE" and p.rate_gbps is not None:
            out[p.link_layer] = max(out.get(p.link_layer, 0.0), p.rate_gbps)
    return out


def decide(ports: list[PortReading], policy: Mapping[str, Any]) -> list[Finding]:
    ignored = set(policy["ignore_ports"])
    watched = [p for p in ports if p.port not in ignored]
    expected = expected_rates(watched, float(policy["expected_rate_gbps"]))
    out: list[Finding] = []
    for p in watched:
        entity = Entity("ib_port", p.port, pci=p.pci)
        evidence = {"state": p.state, "phys_state": p.phys_state, "rate_gbps": p.rate_gbps,
                    "link_layer": p.link_layer, "link_downed": p.link_downed}
        if p.state != "ACTIVE":
            out.append(Finding(CHECK_NAME, "ib-port-down", entity, Status.FAIL,
                               f"{p.port} ({p.link_layer}) is {p.state} / {p.phys_state}: the rail is lost to "
                               "NCCL; drain the node and check cable and switch port", Action.DRAIN, evidence))
            continue
        want = expected.get(p.link_layer)
        if want and p.rate_gbps is not None and p.rate_gbps < want:
            out.append(Finding(CHECK_NAME, "ib-port-slow", entity, Status.FAIL,
                               f"{p.port} runs at {p.rate_gbps:g} Gb/s, expected {want:g} Gb/s: a degraded link "
                               "slows every collective that crosses it", Action.DRAIN,
                               {**evidence, "expected_rate_gbps": want}))
    return out


def read_ports(sysfs: Any, detail: bool = True) -> tuple[list[PortReading], list[Finding]]:
    """Every port's reading. Without `detail` only `state` and `counters/link_downed` are read (phys_state and
    link_layer are empty, rate None): what the once-a-second downtime poll needs, at a third of the reads."""
    ports: list[PortReading] = []
    unreadable: list[Finding] = []
    for hca, name, base in port_dirs(sysfs):
        pci = sysfs.link_target_name(f"{IB_CLASS}/{hca}/device")
        phys, rate, layer, rate_text = "", None, "", ""
        entity = Entity("ib_port", name, pci=pci)
        try:
            text = sysfs.read(f"{base}/state")
            state = parse_state(text)
            if state is None:  # cannot tell up from down: say so, never "down" (a drain) on bytes we cannot read
                raise SourceError(f"{sysfs.path(base + '/state')}: not a port state: {text[:40]!r}")
            if detail:
                phys = _after_colon(sysfs.read(f"{base}/phys_state"))
                rate_text = sysfs.read(f"{base}/rate")
                rate = parse_rate(rate_text)
                layer = sysfs.read(f"{base}/link_layer") if sysfs.exists(f"{base}/link_layer") else "InfiniBand"
        except SourceError as err:
            unreadable.append(Finding(CHECK_NAME, "ib-port-unreadable", entity, Status.UNKNOWN,
                                      f"{name}: could not read port state: {err}"))
            continue
        if detail and rate is None and state == "ACTIVE":  # up, at a speed nobody can say: not judged, not OK
            unreadable.append(Finding(CHECK_NAME, "ib-port-rate-unreadable", entity, Status.UNKNOWN,
                                      f"{name}: rate {rate_text[:40]!r} is not a link rate: whether the port runs "
                                      "at its expected speed is not judged"))
        try:
            downed: int | None = sysfs.read_int(f"{base}/counters/link_downed")
        except SourceError:
            downed = None  # evidence only (absent on some RoCE ports); the state file decides
        ports.append(PortReading(name, pci, state, phys, rate, layer, downed))
    return ports, unreadable


def port_dirs(sysfs: Any) -> list[tuple[str, str, str]]:
    """(HCA, "hca/port" name, sysfs folder) of every port, in order."""
    return [(hca, f"{hca}/{num}", f"{IB_CLASS}/{hca}/ports/{num}") for hca in sysfs.listdir(IB_CLASS)
            for num in sysfs.listdir(f"{IB_CLASS}/{hca}/ports")]


def downtime_files(sysfs: Any) -> list[str]:
    """The files the once-a-second downtime poll reads: each port's state and counters/link_downed."""
    out = []
    for _, _, base in port_dirs(sysfs):
        out.append(f"{base}/state")
        if sysfs.exists(f"{base}/counters/link_downed"):
            out.append(f"{base}/counters/link_downed")
    return out


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    ports, unreadable = read_ports(node.sysfs)
    if not ports and not unreadable:
        raise NotApplicable(f"no InfiniBand/RoCE port under {node.sysfs.path(IB_CLASS)}")
    yield from unreadable
    yield from decide(ports, cfg)


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="InfiniBand/RoCE ports up and at their expected rate",
    run=run,
    defaults={
        "ignore_ports": [],  # "mlx5_bond_0/1": ports not meant to be up
        "expected_rate_gbps": 0.0,  # 0 = the fastest active port of the same link layer
    },
    list_types={"ignore_ports": str},
    timeout_s=10,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="ib_port", order=40, level="quick", look="CHECK", poll="ib_downtime.SPEC", poll_order=1,
    doom=("ib-port-down",),
)
