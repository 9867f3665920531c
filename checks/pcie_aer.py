"""PCIe AER: uncorrectable (fatal / non-fatal) and correctable error counts per device, from the kernel's
`aer_dev_*` statistics in sysfs (deltas against the last sample) and from kernel-log AER lines (a second source,
handed in by the daemon), named by the GPU or NIC at that BDF."""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.errors import NotApplicable, ParseError, SourceError
from gpuwarden.agent.core.kernel_log import LogRecord
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, KernelConsumer, MetricSample, PassiveSpec
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.pci import driver_gpu_uuid, nvidia_pci_gpus
from gpuwarden.agent.sources.sysfs import FileSetProbe
from gpuwarden.checks.line_patterns import load_patterns

CHECK_NAME = "pcie_aer"
PCI = "/sys/bus/pci/devices"
IB_CLASS = "/sys/class/infiniband"
INTERVAL_S = 10.0
SEVERITIES = ("fatal", "nonfatal", "correctable")
FILES = {"fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL"), "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
         "correctable": ("aer_dev_correctable", "TOTAL_ERR_COR")}
HOUR = 3600.0
BUCKET_S = 300.0  # increases within 5 minutes share one stored event: bounded state, "last hour" to 5 minutes
ABSORB_USEC = 1_000_000  # a device's "PCIe Bus Error" line this soon after the port's line is the same error


# ---------------------------------------------------------------- sysfs
@dataclass(frozen=True)
class AerSample:
    boot_id: str | None
    totals: Mapping[str, Mapping[str, int]]  # bdf -> severity -> TOTAL_ERR_*
    nonzero: Mapping[str, Mapping[str, Mapping[str, int]]]  # bdf -> severity -> {counter: n} above zero
    devices: Mapping[str, Mapping[str, Any]]  # bdf -> {"entity": {...}, "hca": str|None, "behind": [...]}
    unreadable: tuple[Finding, ...] = ()


def parse_aer_file(text: str, source: str) -> tuple[int, dict[str, int]]:
    """An aer_dev_* file ("RxErr 0" ... "TOTAL_ERR_COR 0"; old kernels: "Receiver Error 2") -> (total, nonzero)."""
    total, nonzero = None, {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, _, value = line.strip().rpartition(" ")
        if not name or not value.isdigit():
            raise ParseError(f"expected '<counter> <count>', got {line.strip()[:60]!r}", source, lineno)
        if name.startswith("TOTAL_ERR_"):
            total = int(value)
        elif int(value):
            nonzero[name.strip()] = int(value)
    if total is None:
        raise ParseError("no TOTAL_ERR_* line", source)
    return total, nonzero


def _link_path(sysfs: Any, kernel_path: str) -> list[str]:
    try:  # live: bus/pci/devices/<bdf> -> ../../../devices/pci0000:15/0000:15:01.0/.../<bdf>
        return os.readlink(sysfs.path(kernel_path)).split("/")
    except OSError:
        return []  # a recorded node keeps plain folders: no topology, only direct matches


def device_map(node: Any, bdfs: Iterable[str]) -> dict[str, dict[str, Any]]:
    """How findings name each BDF: the GPU there (NVML, else the driver's view), the HCA whose device link points
    there, else a plain PCIe entity with the GPUs/HCAs below it in the hierarchy (live sysfs links only)."""
    sysfs = node.sysfs
    try:
        gpus = {g.pci: g.entity for g in node.gpus() if g.pci}
    except SourceError:  # naming only: without NVML a GPU is still named by its BDF and the driver's UUID
        gpus = {b: Entity("gpu", driver_gpu_uuid(sysfs, b) or b, pci=b) for b in nvidia_pci_gpus(sysfs)}
    hcas = {sysfs.link_target_name(f"{IB_CLASS}/{h}/device"): h for h in sysfs.listdir(IB_CLASS)}
    named = {b: f"GPU {e.index}" if e.index is not None else e.label() for b, e in gpus.items()} | {
        b: h for b, h in hcas.items() if b}
    paths = {b: _link_path(sysfs, f"{PCI}/{b}") for b in named}
    out = {}
    for bdf in bdfs:
        entity = gpus.get(bdf) or Entity("pcie", bdf, pci=bdf)
        behind = sorted(named[b] for b, path in paths.items() if b != bdf and bdf in path[:-1])
        out[bdf] = {"entity": entity.to_dict(), "hca": hcas.get(bdf), "behind": behind}
    return out


def aer_devices(sysfs: Any) -> list[str]:
    """The PCI devices with AER statistics (kernel >= 4.19 and AER on)."""
    return [b for b in sysfs.listdir(PCI) if sysfs.exists(f"{PCI}/{b}/aer_dev_fatal")]


def aer_files(sysfs: Any) -> list[str]:
    """Every aer_dev_* file the sample reads (for the daemon's change probe)."""
    return [f"{PCI}/{b}/{f}" for b in aer_devices(sysfs) for f, _ in FILES.values()]


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> AerSample:
    ignored = set(cfg["ignore_pci"])
    bdfs = aer_devices(node.sysfs)
    if not bdfs:
        raise NotApplicable(f"no aer_dev_* statistics under {node.sysfs.path(PCI)}: AER is off or unsupported here "
                            "(kernels before 4.19 have no such files)")
    totals: dict[str, dict[str, int]] = {}
    nonzero: dict[str, dict[str, dict[str, int]]] = {}
    unreadable = []
    for bdf in (b for b in bdfs if b not in ignored):
        try:
            parsed = {sev: parse_aer_file(node.sysfs.read(f"{PCI}/{bdf}/{f}"), f"{PCI}/{bdf}/{f}")
                      for sev, (f, _) in FILES.items()}
        except (SourceError, ParseError) as err:
            unreadable.append(Finding(CHECK_NAME, "pcie-aer-unreadable", Entity("pcie", bdf, pci=bdf),
                                      Status.UNKNOWN, f"PCIe {bdf}: could not read AER statistics: {err}"))
            continue
        totals[bdf] = {sev: t for sev, (t, _) in parsed.items()}
        nonzero[bdf] = {sev: n for sev, (_, n) in parsed.items() if n}
    return AerSample(node.info.boot_id, totals, nonzero, device_map(node, [*totals, *(f.entity.id for f in
                                                                                      unreadable)]), tuple(unreadable))


# ---------------------------------------------------------------- kernel log
@dataclass(frozen=True)
class AerEvent:
    bdf: str  # the device the error is about
    severity: str  # fatal | nonfatal | correctable
    reporter: str | None  # the root port (or device) that logged it
    message: str
    seq: int | None = None
    usec: int | None = None
    via: str = "root_port"  # root_port | device | ghes (firmware-first, APEI)


# The root port's "error received" line, the device's "PCIe Bus Error" line and a firmware-first (GHES) record's
# lines: the patterns, with the kernel functions that print them, are data (checks/data/pcie_aer.toml); {name: its
# groups} as read below.
_PATTERNS = load_patterns("pcie_aer", {"port": 4, "device": 2, "ghes_severity": 1, "ghes_section": 1, "ghes_device": 1})
_PORT, _DEVICE = _PATTERNS["port"], _PATTERNS["device"]
_GHES_SEV, _GHES_SECTION, _GHES_DEVICE = _PATTERNS["ghes_severity"], _PATTERNS["ghes_section"], _PATTERNS["ghes_device"]
_CPER = {"corrected": "correctable", "recoverable": "nonfatal", "fatal": "fatal"}


def _severity(text: str) -> str:
    return "fatal" if "(Fatal)" in text else "nonfatal" if "(Non-Fatal)" in text else "correctable"


def aer_events_from_records(records: Iterable[LogRecord]) -> list[AerEvent]:
    """AER errors in kernel-log records, one event per error message: the root port's "error received" line, or
    the firmware-first (GHES) block's PCIe device; the device's own "PCIe Bus Error" line right after either is
    the same error (counted once), alone it is an event of its own."""
    events: list[AerEvent] = []
    pending: dict[tuple[str, str], int | None] = {}  # (bdf, severity) -> usec of the line that counted it
    ghes_sev, ghes_pcie = None, False
    for r in records:
        msg = r.message
        if "[Hardware Error]:" in msg:
            if "Hardware error from" in msg:  # a new firmware record starts
                ghes_sev, ghes_pcie = None, False
            elif m := _GHES_SEV.search(msg):
                ghes_sev = _CPER[m.group(1)]
            elif m := _GHES_SECTION.search(msg):
                ghes_pcie = m.group(1).strip() == "PCIe error"
            elif (m := _GHES_DEVICE.search(msg)) and ghes_pcie and ghes_sev:
                events.append(AerEvent(m.group(1), ghes_sev, None, msg, r.seq, r.usec, "ghes"))
                pending[(m.group(1), ghes_sev)] = r.usec
            continue
        if ": AER: " not in msg and "PCIe Bus Error" not in msg:
            continue  # what both patterns below hold: most records handed here are another check's (XIDs)
        if m := _PORT.search(msg):
            port, sev, bdf, rid = m.group(1), _severity(m.group(2)), m.group(3), m.group(4)
            if bdf is None:  # id=BBDF: bus, device<<3|function, in the port's domain
                n = int(rid, 16)
                bdf = f"{port[:4]}:{n >> 8:02x}:{(n & 0xff) >> 3:02x}.{n & 7}"
            events.append(AerEvent(bdf, sev, port, msg, r.seq, r.usec))
            pending[(bdf, sev)] = r.usec
        elif m := _DEVICE.search(msg):
            key = (m.group(1), _severity(m.group(2)))
            if key in pending:
                at = pending.pop(key)
                if at is None or r.usec is None or abs(r.usec - at) <= ABSORB_USEC:
                    continue
            events.append(AerEvent(key[0], key[1], key[0], msg, r.seq, r.usec, "device"))
    return events


# ---------------------------------------------------------------- state and judgement
def _hold(cfg: Mapping[str, Any]) -> float:
    return float(cfg["uncorrectable_hold_s"]) or float("inf")  # 0 = until the next boot


def _add(events: list[list[Any]], now: float, sev: str, n: int, cfg: Mapping[str, Any]) -> None:
    """Stored events are [first_t, last_t, severity, count]; increases within BUCKET_S of a bucket's start join it
    (uncorrectable ones held until the next boot all join one)."""
    bucket = BUCKET_S if sev == "correctable" or _hold(cfg) < float("inf") else float("inf")
    for e in reversed(events):
        if e[2] == sev:
            if now - e[0] < bucket:
                e[1], e[3] = max(e[1], now), e[3] + n  # a backlog event may be older than the bucket's last
                return
            break
    events.append([now, now, sev, n])


def _prune(events: list[list[Any]], now: float, cfg: Mapping[str, Any]) -> list[list[Any]]:
    return [e for e in events if e[1] > now - (HOUR if e[2] == "correctable" else max(HOUR, _hold(cfg)))]


def _count(events: Iterable[list[Any]], sev: str, since: float) -> int:
    return sum(e[3] for e in events if e[2] == sev and e[1] > since)


def _new_boot(state: Mapping[str, Any], boot_id: str | None) -> dict[str, Any]:
    """The state to build on: the same boot's, or a fresh one (counters restart with the kernel)."""
    if state.get("version") == 1 and (boot_id is None or state.get("boot_id") in (None, boot_id)):
        return {"version": 1, "boot_id": boot_id or state.get("boot_id"), "devices": dict(state["devices"]),
                "sysfs": dict(state["sysfs"]), **({"kmsg": state["kmsg"]} if "kmsg" in state else {})}
    return {"version": 1, "boot_id": boot_id, "devices": {}, "sysfs": {}}


def _advance(prev: Mapping[str, Any] | None, totals: Mapping[str, int], nonzero: Any, now: float,
             cfg: Mapping[str, Any]) -> dict[str, Any]:
    if prev is None:  # first look: counts so far predate gpuwarden (history, not news)
        return {"baseline": dict(totals), "totals": dict(totals), "nonzero": nonzero, "events": [], "resets": 0}
    events, baseline, resets = [list(e) for e in prev["events"]], dict(prev["baseline"]), prev["resets"]
    for sev in SEVERITIES:
        before, after = prev["totals"][sev], totals[sev]
        if after < before:  # re-enumerated (removed and rescanned): every count is newer than our last look
            resets, baseline[sev], delta = resets + 1, 0, after
        else:
            delta = after - before
        if delta:
            _add(events, now, sev, delta, cfg)
    return {"baseline": baseline, "totals": dict(totals), "nonzero": nonzero, "events": _prune(events, now, cfg),
            "resets": resets}


def judge(state: Mapping[str, Any], sample: AerSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    st = _new_boot(state, sample.boot_id)
    old = st["sysfs"]
    st["sysfs"] = {b: _advance(old.get(b), t, sample.nonzero[b], now, cfg) for b, t in sample.totals.items()}
    ignored = set(cfg["ignore_pci"])
    for bdf, prev in old.items():
        if bdf in st["sysfs"] or bdf in ignored:
            continue
        if any(f.entity.id == bdf for f in sample.unreadable):
            st["sysfs"][bdf] = prev  # could not look: keep what we knew
        elif events := _prune([list(e) for e in prev["events"]], now, cfg):
            st["sysfs"][bdf] = {**prev, "events": events, "gone": True}  # left the bus: its errors still count
    st["devices"] = {**st["devices"], **sample.devices}
    st["devices"] = {b: d for b, d in st["devices"].items() if b in st["sysfs"] or b in st.get("kmsg", {})}
    return _judgement(st, cfg, now, sample.unreadable)


def judge_kernel_records(state: Mapping[str, Any], records: Iterable[LogRecord], cfg: Mapping[str, Any],
                         now: float, boot_id: str | None = None, event_time: Any = None) -> Judgement:
    """The kernel-log part: new records (each handed over once) -> events held in the same state. The first batch
    this state ever sees (a fresh install, a new boot) is what happened before gpuwarden looked: history. An event
    counts from the time it was logged (`event_time`, KernelBatch's), so a backlog read after a restart is not news."""
    st = _new_boot(state, boot_id)
    history = "kmsg" not in st
    kmsg = {b: {"counts": dict(k["counts"]), "events": [list(e) for e in k["events"]], "last": k["last"]}
            for b, k in st.get("kmsg", {}).items()}
    ignored = set(cfg["ignore_pci"])
    for ev in aer_events_from_records(records):
        if ev.bdf in ignored:
            continue
        k = kmsg.setdefault(ev.bdf, {"counts": dict.fromkeys(SEVERITIES, 0), "events": [], "last": ""})
        k["counts"][ev.severity] += 1
        k["last"] = ev.message[:200]
        if not history:
            _add(k["events"], event_time(ev) if event_time else now, ev.severity, 1, cfg)
    for k in kmsg.values():
        k["events"] = _prune(k["events"], now, cfg)
    st["kmsg"] = kmsg
    return _judgement(st, cfg, now, ())


def decide(bdf: str, s: Mapping[str, Any] | None, k: Mapping[str, Any] | None, dev: Mapping[str, Any],
           cfg: Mapping[str, Any], now: float) -> list[Finding]:
    """One device's findings from its sysfs (`s`) and kernel-log (`k`) state; both sources see the same errors,
    so each count is the larger of the two, never their sum."""
    entity = Entity.from_dict(dev["entity"]) if dev else Entity("pcie", bdf, pci=bdf)
    name = entity.label() if entity.kind == "gpu" else f"PCIe {bdf}" + (f" ({dev['hca']})" if dev.get("hca") else "")
    if dev.get("behind"):
        name += f", upstream of {', '.join(dev['behind'])}"
    hold = _hold(cfg)

    def most(sev: str, since: float) -> int:
        return max(_count(s["events"], sev, since) if s else 0, _count(k["events"], sev, since) if k else 0)

    new = {sev: most(sev, now - hold) for sev in ("fatal", "nonfatal")}
    boot = {sev: max(s["totals"][sev] if s else 0, k["counts"][sev] if k else 0) for sev in SEVERITIES}
    evidence: dict[str, Any] = {"pci": bdf, "new_fatal": new["fatal"], "new_nonfatal": new["nonfatal"],
                                "hold_s": cfg["uncorrectable_hold_s"], "this_boot": boot}
    if s:
        evidence |= {"sysfs_totals": s["totals"], "predating_gpuwarden": s["baseline"], "counters": s["nonzero"],
                     **({"gone_from_sysfs": True} if s.get("gone") else {})}
    if k:
        evidence |= {"kernel_log": k["counts"], "kernel_log_last": k["last"]}
    evidence |= {key: dev[key] for key in ("hca", "behind") if dev.get(key)}
    out = []
    if new["fatal"]:
        # pcieaer-howto: a fatal error makes the link unreliable and the kernel resets it under the driver (drivers
        # cannot opt out); a device reset under its running driver does not come back clean: reboot.
        out.append(Finding(CHECK_NAME, "pcie-aer-uncorrectable", entity, Status.FAIL,
                           f"{name}: {new['fatal']} fatal uncorrectable PCIe error(s): the link was reset under the "
                           "driver; reboot the node", Action.REBOOT, evidence))
    elif new["nonfatal"]:
        # pcieaer-howto: non-fatal = a transaction was lost or corrupted; the link itself still works.
        out.append(Finding(CHECK_NAME, "pcie-aer-uncorrectable", entity, Status.FAIL,
                           f"{name}: {new['nonfatal']} non-fatal uncorrectable PCIe error(s): a transaction was lost; "
                           "drain the node and look at the device", Action.DRAIN, evidence))
    elif boot["fatal"] or boot["nonfatal"]:
        out.append(Finding(CHECK_NAME, "pcie-aer-uncorrectable-history", entity, Status.WARN,
                           f"{name}: {boot['fatal']} fatal / {boot['nonfatal']} non-fatal uncorrectable PCIe error(s) "
                           "earlier this boot", Action.MONITOR, evidence))
    per_hour, limit = most("correctable", now - HOUR), cfg["correctable_warn_per_hour"]
    if limit and per_hour >= limit:
        out.append(Finding(CHECK_NAME, "pcie-aer-correctable", entity, Status.WARN,
                           f"{name}: {per_hour} correctable PCIe errors in the last hour (limit {limit}): a marginal "
                           "link; watch it", Action.MONITOR, {**evidence, "correctable_last_hour": per_hour}))
    return out


def _judgement(st: dict[str, Any], cfg: Mapping[str, Any], now: float, unreadable: Iterable[Finding]) -> Judgement:
    findings = list(unreadable)
    kmsg = st.get("kmsg", {})
    for bdf in sorted((set(st["sysfs"]) | set(kmsg)) - set(cfg["ignore_pci"])):
        findings += decide(bdf, st["sysfs"].get(bdf), kmsg.get(bdf), st["devices"].get(bdf, {}), cfg, now)
    metrics = tuple(MetricSample("gpuwarden_pcie_aer_errors", "AER errors the kernel counted for the PCIe device "
                                 "since boot (aer_dev_* TOTAL_ERR_*).", {"pci": bdf, "severity": sev}, float(n))
                    for bdf, s in sorted(st["sysfs"].items()) if not s.get("gone") for sev, n in s["totals"].items())
    return Judgement(st, tuple(findings), metrics)


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="PCIe AER uncorrectable and correctable errors per device (sysfs aer_dev_* deltas, kernel-log AER lines)",
    sample=sample,
    judge=judge,
    interval_s=INTERVAL_S,
    defaults={
        # DCGM's PCIe health watch warns above 8 replays/minute ("the maximum recommended by RM") = 480/hour.
        "correctable_warn_per_hour": 480,  # 0 = do not judge correctable errors
        "uncorrectable_hold_s": 3600.0,  # a new uncorrectable error FAILs this long, then WARNs (0 = until reboot)
        "ignore_pci": [],  # BDFs not to judge
    },
    list_types={"ignore_pci": str},
    timeout_s=10.0,
    # Without findings nothing is pending that time alone could raise: equal counters judged again change nothing.
    quiet=lambda state: True,
    quiet_rejudge_s=300.0,
    change_probe=lambda node: FileSetProbe(node.sysfs, aer_files),
)


def _judge_batch(state: Mapping[str, Any], batch: Any, cfg: Mapping[str, Any], now: float) -> Judgement:
    return judge_kernel_records(state, batch.records, cfg, now, boot_id=batch.boot_id,
                                event_time=getattr(batch, "event_time", None))


def kernel_quiet(state: Mapping[str, Any]) -> bool:
    """No error event in any window (sysfs's or the kernel log's), and the kernel log's history already taken (the
    first batch is what happened before gpuwarden looked): an empty batch would judge the same."""
    return state.get("version") == 1 and "kmsg" in state and not any(
        d.get("events") for part in ("sysfs", "kmsg") for d in state.get(part, {}).values())


# The kernel-log half of the same check: same name, so the daemon keeps ONE state and one set of findings for
# pcie_aer, fed by both the sysfs poll and the followed kernel log (judged one at a time).
KERNEL_CONSUMER = KernelConsumer(name=CHECK_NAME, summary=SPEC.summary, judge=_judge_batch, defaults=SPEC.defaults,
                                 list_types=SPEC.list_types, quiet=kernel_quiet,
                                 interest=("AER", "PCIe Bus Error", "[Hardware Error]:"))

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="pcie_aer", order=80, level="quick", look="SPEC", poll="SPEC", poll_order=5, kernel="KERNEL_CONSUMER",
    kernel_order=2,
)
