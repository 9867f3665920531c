"""InfiniBand / RoCE port downtime over time: port state looked at when the devices report a port event (every 10 s
besides) or, where they cannot, every second, and every second while a port is down; plus `counters/link_downed`
(so a flap shorter than the look still counts), accumulated per port in a sliding window that survives restarts.
The criterion is downtime, not flap count: a port down past the NCCL IB timeout, or down too long in total."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from gpuwarden.agent.core.errors import NotApplicable
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.sysfs import FileSetProbe
from gpuwarden.checks.ib_port import IB_CLASS, PortReading, downtime_files, read_ports

CHECK_NAME = "ib_port"  # the daemon form of the ib_port concern: one name, one config table
INTERVAL_S = 1.0
COUNTER_MAX = 255  # IB PMA LinkDownedCounter is 8 bits and saturates there (it does not wrap)
EVENT_LOOK_S = 10.0  # with port events watched, the longest wait between two looks while every port is up
MAX_GAP_S = 5.0  # an outage that ends across a stretch nobody watched is charged at most this past the last look
MAX_INTERVALS = 128  # down intervals kept per port; beyond that the oldest two merge (bounded state)
MISSING = "MISSING"  # the state of a port whose HCA has left /sys/class/infiniband


@dataclass(frozen=True)
class DowntimeSample:
    ports: tuple[PortReading, ...]
    unreadable: tuple[Finding, ...]  # UNKNOWN per port whose state files could not be read


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> DowntimeSample:
    ports, unreadable = read_ports(node.sysfs, detail=False)
    if not ports and not unreadable and not state.get("ports"):
        raise NotApplicable(f"no InfiniBand/RoCE port under {node.sysfs.path(IB_CLASS)}")
    return DowntimeSample(tuple(ports), tuple(replace(f, check=CHECK_NAME) for f in unreadable))


def advance(prev: Mapping[str, Any] | None, up: bool, label: str, downed: int | None, pci: str | None,
            now: float, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """One port's state after a sample. An outage runs from the first sample that sees the port down to the
    first that sees it up again: unbiased at a regular poll (the real start and end each lie within one
    interval before), and never charged for time nobody watched beyond MAX_GAP_S."""
    if prev is None:  # first sight: a baseline; a port already down is charged from now on, not before
        return {"up": up, "state": label, "t": now, "link_downed": downed, "down_since": None if up else now,
                "down_flaps": 0, "intervals": [], "resets": 0, "pci": pci}
    last_t = float(prev["t"])
    elapsed = max(0.0, now - last_t)
    went_down = prev["up"] and not up
    intervals = [list(i) for i in prev["intervals"]]
    resets, hidden = int(prev["resets"]), 0
    old = prev["link_downed"]
    if downed is not None and old is not None:
        if downed >= old:
            # The increment of a down transition we saw ourselves is that outage, not a hidden flap.
            hidden = max(0, downed - old - (1 if went_down else 0))
        else:
            resets += 1  # cleared (driver reload, perfquery -R): a new baseline, no downtime invented
    if hidden:  # down and up again between two polls: charge flap_charge_s each, never more than elapsed
        charge = min(elapsed, hidden * float(cfg["flap_charge_s"]))
        intervals.append([now - charge, now, charge, hidden])
    down_since, down_flaps = prev["down_since"], int(prev["down_flaps"])
    if went_down:
        down_since, down_flaps = now, 1
    elif up and not prev["up"]:
        end = min(now, last_t + MAX_GAP_S)
        intervals.append([down_since, end, max(0.0, end - down_since), down_flaps])
        down_since, down_flaps = None, 0
    lo = now - float(cfg["window_s"])
    intervals = [i for i in intervals if i[1] > lo]
    while len(intervals) > MAX_INTERVALS:
        (s, _, d1, f1), (_, e, d2, f2) = intervals[0], intervals[1]
        intervals[:2] = [[s, e, d1 + d2, f1 + f2]]
    return {"up": up, "state": label, "t": now, "link_downed": downed if downed is not None else old,
            "down_since": down_since, "down_flaps": down_flaps, "intervals": intervals, "resets": resets,
            "pci": pci or prev.get("pci")}


def window_totals(port: Mapping[str, Any], now: float, window_s: float) -> tuple[float, int]:
    """(down seconds, flaps) in (now - window_s, now], the ongoing outage included."""
    lo = now - window_s
    down, flaps = 0.0, 0
    for start, end, seconds, n in port["intervals"]:
        if end <= lo:
            continue
        flaps += n
        down += seconds if start >= lo or end <= start else seconds * (end - lo) / (end - start)
    if port["down_since"] is not None:
        down += max(0.0, now - max(port["down_since"], lo))
        flaps += port["down_flaps"]
    return down, flaps


def decide(name: str, port: Mapping[str, Any], now: float, cfg: Mapping[str, Any]) -> Finding | None:
    window = float(cfg["window_s"])
    down, flaps = window_totals(port, now, window)
    down_for = None if port["down_since"] is None else round(max(0.0, now - port["down_since"]), 3)
    evidence = {"state": port["state"], "down_for_s": down_for, "down_since": port["down_since"],
                "down_s_in_window": round(down, 3),
                "flaps_in_window": flaps, "window_s": window, "link_downed": port["link_downed"],
                "link_downed_saturated": port["link_downed"] == COUNTER_MAX, "counter_resets": port["resets"]}
    entity = Entity("ib_port", name, pci=port["pci"])
    if down_for is not None and down_for >= cfg["down_fail_s"]:
        if port["state"] == MISSING:
            return Finding(CHECK_NAME, "ib-port-missing", entity, Status.FAIL,
                           f"{name} has been gone from {IB_CLASS} for {down_for:.0f} s (HCA lost or its driver "
                           "unloaded): the rail is lost to NCCL; drain the node (ignore_ports if it was removed on "
                           "purpose)", Action.DRAIN, evidence)
        return Finding(CHECK_NAME, "ib-port-down", entity, Status.FAIL,
                       f"{name} has been {port['state']} for {down_for:.0f} s (limit {cfg['down_fail_s']:g} s; NCCL "
                       "gives up on a rail after ~7 s): collectives over this rail fail; drain the node and check "
                       "cable and switch port", Action.DRAIN, evidence)
    summary = f"{name} was down {down:.1f} s in the last {window:g} s ({flaps} flap(s))"
    if down >= cfg["window_fail_s"]:
        return Finding(CHECK_NAME, "ib-port-flapping", entity, Status.FAIL,
                       f"{summary}: an unstable link kills collectives; drain the node and check cable, "
                       "transceiver and switch port", Action.DRAIN, evidence)
    if down >= cfg["window_warn_s"]:
        return Finding(CHECK_NAME, "ib-port-flapping", entity, Status.WARN, f"{summary}: watch this link",
                       Action.MONITOR, evidence)
    return None


def judge(state: Mapping[str, Any], sample: DowntimeSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    ignored = set(cfg["ignore_ports"])
    old = state.get("ports", {})
    seen = {p.port: p for p in sample.ports if p.port not in ignored}
    unreadable = [f for f in sample.unreadable if f.entity.id not in ignored]
    ports: dict[str, Any] = {}
    for name in sorted((set(seen) | set(old)) - ignored):
        if name in seen:
            p = seen[name]
            ports[name] = advance(old.get(name), p.state == "ACTIVE", p.state, p.link_downed, p.pci, now, cfg)
        elif any(f.entity.id == name for f in unreadable):
            ports[name] = old[name]  # could not look: nothing learnt (the UNKNOWN finding says so)
        else:
            ports[name] = advance(old[name], False, MISSING, None, None, now, cfg)
    findings = list(unreadable)
    metrics: list[MetricSample] = []
    for name, port in ports.items():
        f = decide(name, port, now, cfg)
        if f is not None:
            findings.append(f)
        down, flaps = window_totals(port, now, float(cfg["window_s"]))
        labels = {"port": name}
        metrics += [
            MetricSample("gpuwarden_ib_port_up", "Whether the IB/RoCE port is ACTIVE (1) or not (0).", labels,
                         1.0 if port["up"] else 0.0),
            MetricSample("gpuwarden_ib_port_down_seconds", "Seconds the port was down in the sliding window.",
                         labels, round(down, 3)),
            MetricSample("gpuwarden_ib_port_flaps_in_window", "Link-down events of the port in the sliding window.",
                         labels, float(flaps)),
        ]
        if port["link_downed"] is not None:
            metrics.append(MetricSample("gpuwarden_ib_port_link_downed", "The port's link_downed counter "
                                        "(8 bits, saturates at 255).", labels, float(port["link_downed"])))
    return Judgement({"version": 1, "ports": ports}, tuple(findings), tuple(metrics))


def port_events(node: Any, files: list[str]) -> Any:
    """The events of the ports whose `state` files are among ``files`` (node.ib_port_events)."""
    dirs = sorted({f.rsplit("/", 1)[0] for f in files if f.endswith("/state")})
    prefix = IB_CLASS + "/"
    devices = sorted({d[len(prefix):].split("/", 1)[0] for d in dirs if d.startswith(prefix)})
    return node.ib_port_events(devices, dirs)


def durable(state: Mapping[str, Any]) -> dict[str, Any]:
    """All of the state but the last-look time of a port that is up: while every port is up and quiet that time
    is all a poll changes, and losing it to a kill -9 only loosens the cap on charged hidden flaps. The time of
    a port that is down is kept, because it bounds the outage charged across a restart (MAX_GAP_S)."""
    return {name: {k: v for k, v in port.items() if k != "t" or not port["up"]}
            for name, port in state.get("ports", {}).items()}


def quiet(state: Mapping[str, Any]) -> bool:
    """Every port up: with the same readings (state, link_downed) another look changes nothing but time."""
    return all(port["up"] for port in state.get("ports", {}).values())


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="IB/RoCE port cumulative downtime (port events, or the state polled every second, plus link_downed) in a "
            "sliding window",
    sample=sample,
    judge=judge,
    interval_s=INTERVAL_S,
    defaults={
        # A port down this long now fails. NCCL's effective IB timeout is ~7 s: an outage longer than that kills
        # the collective, so the scheduler must hear of it well before; two 1 s polls filter a one-sample glitch.
        "down_fail_s": 2.0,
        "window_s": 3600.0,  # sliding window of the cumulative downtime
        "window_fail_s": 30.0,  # downtime in the window that fails (drain)
        "window_warn_s": 5.0,  # downtime in the window that warns
        "flap_charge_s": 0.5,  # downtime charged per flap seen only through link_downed (half the poll interval)
        "ignore_ports": [],  # "mlx5_bond_0/1": ports not meant to be up
    },
    list_types={"ignore_ports": str},
    timeout_s=5.0,
    durable=durable,
    quiet=quiet,
    quiet_rejudge_s=60.0,  # a new port, or a gauge decaying in the window, shows within a minute
    # The state files every second; link_downed (flaps between polls, charged flap_charge_s each) every 5th: a
    # flap counted a few seconds late changes no window total, and the 1 s look is most of the idle cost. Where the
    # devices' port events can be had, a port going down or up is sampled when its event comes, and while every
    # port is up the files are looked at every EVENT_LOOK_S only (each look at a live port's state is a query the
    # driver puts to the HCA); while a port is down, every second.
    change_probe=lambda node: FileSetProbe(node.sysfs, downtime_files, slow=lambda p: p.endswith("/link_downed"),
                                           slow_every=5, events=lambda files: port_events(node, files)),
    event_look_s=EVENT_LOOK_S,
)
