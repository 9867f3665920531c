"""The xid check: NVIDIA XID errors in the kernel log, one finding per GPU and XID code, with the action
NVIDIA's XID catalogue recommends (for XID 154, the recovery action the driver names in the message)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from gpuwarden.agent.check import CheckSpec
from gpuwarden.agent.errors import ParseError, SourceError
from gpuwarden.agent.kernel_log import LogRecord, parse_log_text
from gpuwarden.agent.model import Action, Entity, Finding, Status

from .xid_catalog import XidInfo, load_catalog, recovery_action

CHECK_NAME = "xid"
_PCI = r"PCI:([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?"
# "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
_XID = re.compile(r"NVRM: Xid \(" + _PCI + r"\): (\d{1,6})(?![\d])(.*)")
# "NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b" (printed before an XID)
_PREAMBLE = re.compile(r"NVRM: GPU at " + _PCI + r": (GPU-[0-9a-fA-F-]{8,})")
_MAX_EVIDENCE_PIDS = 10


class GpuRef(Protocol):
    index: int | None
    uuid: str | None
    pci: str | None  # canonical BDF, "0000:91:00.0"

    @property
    def entity(self) -> Entity: ...


@dataclass(frozen=True)
class XidEvent:
    xid: int
    pci: str  # canonical lower-case BDF with function, "0000:91:00.0"
    pid: str | None
    process: str | None
    detail: str  # the driver's text after pid/name
    record: LogRecord | None = None


@dataclass(frozen=True)
class LoggedGpu:
    """A GPU known only from the driver's "GPU at PCI:... GPU-<uuid>" line (NVML lost it or is absent)."""

    uuid: str
    pci: str
    index: int | None = None

    @property
    def entity(self) -> Entity:
        return Entity("gpu", self.uuid, None, self.pci)


def _bdf(domain: str, bus: str, device: str, function: str | None) -> str:
    # NVRM prints domain:bus:device; the function of a GPU is 0.
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function or '0'}"


def _field_value(text: str) -> str | None:
    value = text.strip().strip("'`\"")  # pid='<unknown>', pid='`<unknown>`' (a markdown-mangled copy)
    return None if value in ("", "<unknown>") else value


def parse_xid(message: str, record: LogRecord | None = None) -> XidEvent | None:
    """The XID in one kernel message, or None (SXid, "Xid PCI:..." without parentheses, other lines)."""
    m = _XID.search(message)
    if m is None:
        return None
    rest = m[6].lstrip(",").strip()
    pid = process = None
    if rest.startswith("pid="):
        value, _, rest = rest[4:].partition(",")
        pid, rest = _field_value(value), rest.lstrip()
        if rest.startswith("name="):
            value, _, rest = rest[5:].partition(",")
            process, rest = _field_value(value), rest.lstrip()
    return XidEvent(int(m[5]), _bdf(m[1], m[2], m[3], m[4]), pid, process, rest.strip(), record)


def parse_gpu_preamble(message: str) -> tuple[str, str] | None:
    """(pci, uuid) from the driver's "NVRM: GPU at PCI:0000:91:00: GPU-..." line, else None."""
    m = _PREAMBLE.search(message)
    return (_bdf(m[1], m[2], m[3], m[4]), m[5]) if m else None


def collect(records: Iterable[LogRecord]) -> tuple[list[XidEvent], list[LoggedGpu]]:
    """XID events, and the GPUs the driver named in preamble lines, from kernel log records."""
    events: list[XidEvent] = []
    logged: dict[str, LoggedGpu] = {}
    for r in records:
        if "NVRM: " not in r.message:  # cheap filter: most kernel lines are not the NVIDIA driver's
            continue
        event = parse_xid(r.message, r)
        if event is not None:
            events.append(event)
            continue
        preamble = parse_gpu_preamble(r.message)
        if preamble is not None:
            logged[preamble[0]] = LoggedGpu(preamble[1], preamble[0])
    return events, list(logged.values())


def decide(events: Sequence[XidEvent], gpus: Sequence[GpuRef], catalog: Mapping[int, XidInfo],
           policy: Mapping[str, Any]) -> list[Finding]:
    """One finding per (GPU, XID code), in order of first appearance. An XID whose action is NONE is still
    listed, with status OK: it is information for a post-mortem, not a fault."""
    ignore = {int(x) for x in policy.get("ignore_xids", ())}
    force = {int(x) for x in policy.get("fail_xids", ())}
    entity_at = entity_lookup(gpus)
    groups: dict[tuple[str, int], list[XidEvent]] = {}
    codes_on: dict[str, set[int]] = {}
    for event in events:
        groups.setdefault((event.pci, event.xid), []).append(event)
        codes_on.setdefault(event.pci, set()).add(event.xid)

    findings: list[Finding] = []
    for (pci, xid), group in groups.items():
        if xid in ignore:
            continue
        # Catalogue, XID 45: "Not Solo: IGNORE (follow guidance in other Xid)": the teardown that follows
        # another fault on the same GPU adds nothing; only a solo 45 stands on its own.
        accompanied_45 = xid == 45 and len(codes_on[pci]) > 1
        info = catalog.get(xid)
        action = xid_action(xid, info, group[-1].detail, accompanied_45, xid in force)
        findings.append(_finding(xid, entity_at(pci), group, info, action, forced=xid in force))
    return findings


def xid_action(xid: int, info: XidInfo | None, last_detail: str, accompanied_45: bool, forced: bool) -> Action:
    """The recommended action for one GPU's XID: the catalogue's, with the rules the catalogue itself states,
    raised to at least DRAIN when the operator's policy says so (fail_xids)."""
    action = info.action if info else Action.MONITOR
    if xid == 154:
        # Each 154 reports a change of the GPU's recovery action; the latest one is what holds now.
        named = recovery_action(last_detail)
        action = named if named is not None else action
    if forced:
        return max(action, Action.DRAIN)
    if accompanied_45:
        return Action.NONE  # catalogue, XID 45: "Not Solo: IGNORE (follow guidance in other Xid)"
    return action


def xid_status(action: Action) -> Status:
    return Status.FAIL if action >= Action.DRAIN else Status.WARN if action > Action.NONE else Status.OK


def entity_lookup(gpus: Sequence[GpuRef]) -> Callable[[str], Entity]:
    """PCI address -> entity. Earlier refs (NVML) win over later ones (driver preamble lines)."""
    by_pci: dict[str, GpuRef] = {}
    by_uuid: dict[str, GpuRef] = {}
    uuid_at: dict[str, str] = {}
    for gpu in gpus:
        pci = (gpu.pci or "").lower()
        if pci:
            by_pci.setdefault(pci, gpu)
        if gpu.uuid:
            by_uuid.setdefault(gpu.uuid, gpu)
            uuid_at.setdefault(pci, gpu.uuid)

    def entity(pci: str) -> Entity:
        gpu = by_pci.get(pci)
        if gpu is not None and gpu.index is None and gpu.uuid in by_uuid:
            gpu = by_uuid[gpu.uuid]  # named by the driver; NVML knows that UUID (and its index)
        if gpu is None:
            return Entity("gpu", pci, None, pci)
        e = gpu.entity
        if gpu.uuid and e.pci:
            return e
        # NVML lost the GPU (XID 79) and cannot say its UUID or address; the driver printed both.
        return Entity(e.kind, gpu.uuid or uuid_at.get(pci) or e.id, e.index, e.pci or pci, e.link)

    return entity


def _finding(xid: int, entity: Entity, group: list[XidEvent], info: XidInfo | None, action: Action,
             forced: bool) -> Finding:
    first, last = group[0], group[-1]
    what = f"XID {xid} ({info.description}) on {entity.label()}: {info.name}" if info else (
        f"XID {xid} on {entity.label()}: not in NVIDIA's XID catalogue; watch for repeats")
    detail = last.detail if len(last.detail) <= 120 else last.detail[:117] + "..."
    why = " (policy fail_xids)" if forced else ""
    message = f'{what}; {len(group)} event(s), last: "{detail}"; recommended: {action.name}{why}'
    pids = sorted({e.pid for e in group if e.pid})[:_MAX_EVIDENCE_PIDS]
    processes = sorted({e.process for e in group if e.process})[:_MAX_EVIDENCE_PIDS]
    status = xid_status(action)
    evidence = {
        "count": len(group),
        "source": getattr(first.record, "source", None),
        "first_line": getattr(first.record, "line", None),
        "last_line": getattr(last.record, "line", None),
        "first_seq": getattr(first.record, "seq", None),
        "last_seq": getattr(last.record, "seq", None),
        "first_time": _when(first.record),
        "last_time": _when(last.record),
        "first_message": first.record.message if first.record else first.detail,
        "bucket": info.bucket if info else None,
        "pids": pids,
        "processes": processes,
    }
    return Finding(CHECK_NAME, str(xid), entity, status, message, action, evidence)


def _when(record: LogRecord | None) -> str | int | None:
    return None if record is None else record.timestamp if record.timestamp is not None else record.usec


def analyze_text(text: str, source: str, gpus: Sequence[GpuRef] = ()) -> tuple[list[Finding], list[ParseError]]:
    """`gpuwarden analyze FILE` for a kernel log: the findings the live check would give on this text."""
    records, errors = parse_log_text(text, source)
    events, logged = collect(records)
    return decide(events, [*gpus, *logged], load_catalog(), CHECK.defaults), errors


def recent(records: Sequence[LogRecord], window_s: float, now_usec: int | None) -> list[LogRecord]:
    """Records of the last `window_s` seconds (0 = the whole boot). `now_usec` is the node's uptime; without
    it, the newest record's time stands in (a recorded node)."""
    if window_s <= 0:
        return list(records)
    stamps = [r.usec for r in records if r.usec is not None]
    now = now_usec if now_usec is not None else max(stamps, default=0)
    oldest = now - int(window_s * 1_000_000)
    return [r for r in records if r.usec is None or r.usec >= oldest]


def run(node: Any, cfg: Mapping[str, Any]) -> Iterator[Finding]:
    records = node.kmsg.records()  # SourceError propagates: the runner reports UNKNOWN
    records = recent(records, cfg["window_s"], node.uptime_usec())
    try:
        # node.gpus(): NVML's list with the PCI/UUID of a lost GPU filled in from sysfs and the driver.
        gpus = list(node.gpus())
    except SourceError:
        gpus = []  # the XIDs still count, keyed by the PCI address the driver printed
    events, logged = collect(records)
    yield from decide(events, [*gpus, *logged], load_catalog(), cfg)


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="NVIDIA XID errors in the kernel log, with the action NVIDIA's XID catalogue recommends",
    run=run,
    # window_s: judge only XIDs of the last N seconds (0 = since boot). A preflight after a GPU reset would
    # otherwise keep failing on the XID that caused the reset until the next reboot.
    defaults={"ignore_xids": [], "fail_xids": [], "window_s": 0.0},
    list_types={"ignore_xids": int, "fail_xids": int},
    timeout_s=30,
)
