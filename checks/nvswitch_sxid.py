"""NVSwitch SXid errors from the followed kernel log (and Fabric Manager's log): one incident per switch and SXid
code; fatal ones drain, non-fatal ones warn.

A check of its own, not part of `fabric`: the daemon replaces a check's findings with each judgement, so a poll of
the fabric must not erase an SXid incident and the other way round.

Source of the severity split: the kernel prints "Fatal" or "Non-fatal"; DCGM's NVSwitch health watch fails on fatal
and warns on non-fatal errors ("Monitor the NVSwitch. It can still perform workload."), NVSentinel's SXid handler
does the same (NVIDIA/NVSentinel health-monitors/syslog-health-monitor/pkg/sxid).
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.kernel_log import LogRecord, parse_log_text
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, KernelConsumer, MetricSample, boot_batch
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks import unread_lines
from gpuwarden.checks.line_patterns import load_patterns

SXID_CHECK_NAME = "nvswitch_sxid"

_MAX_LINE = 4096  # the driver's lines are a few hundred characters; a longer one is read cut
# "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up" and its detail lines; Fabric
# Manager's "detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus id ...": the patterns, with their
# sources, are data (checks/data/nvswitch_sxid.toml); {name: its groups} as read below.
_PATTERNS = load_patterns("nvswitch_sxid", {"kernel": 7, "severity": 3, "fabricmanager": 8})
_SXID, _SEVERITY, _FM = _PATTERNS["kernel"], _PATTERNS["severity"], _PATTERNS["fabricmanager"]


@dataclass(frozen=True)
class SxidEvent:
    sxid: int
    pci: str  # the NVSwitch, canonical BDF "0000:06:00.0"
    fatal: bool | None  # None: the line does not say (Severity/Data detail lines, SOE messages)
    link: int | None  # NVSwitch link (port) number
    detail: str
    switch: str | None  # "nvidia-nvswitch1" (kernel) or "physical id 3" (Fabric Manager log)
    origin: str  # "kernel" | "fabricmanager"
    record: LogRecord | None = None


def _bdf(domain: str, bus: str, dev: str, fn: str) -> str:
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def parse_sxid(message: str, record: LogRecord | None = None) -> SxidEvent | None:
    """The SXid event in one kernel or Fabric Manager log message, or None."""
    m = _SXID.search(message)
    if m:
        rest = m[7].strip()
        sev = _SEVERITY.match(rest)
        fatal = link = None
        if sev:
            fatal, rest = sev[1].lower() == "fatal", sev[3].strip()
            link = int(sev[2]) if sev[2] else None
        return SxidEvent(int(m[6]), _bdf(m[2], m[3], m[4], m[5]), fatal, link, rest, m[1], "kernel", record)
    m = _FM.search(message)
    if m:
        return SxidEvent(int(m[2]), _bdf(m[3], m[4], m[5], m[6]), m[1].lower() == "fatal",
                         int(m[8]) if m[8] else None, message[m.end():].strip(),
                         f"physical id {m[7]}" if m[7] else None, "fabricmanager", record)
    return None


def sxid_events_from_records(records: Iterable[LogRecord],
                             unread: list[LogRecord] | None = None) -> list[SxidEvent]:
    """The SXid events in `records`; a record that mentions an SXid in a form not read here goes to `unread`."""
    out = []
    messages = getattr(records, "messages", None)  # a saved log's records: made only for the lines read here
    if messages is None:
        records = list(records)
        messages = [r.message for r in records]
    # Cheap filter before the regexes, on each text once (a flood of other lines repeats a few texts): a pass of C
    # over the batch finds its texts, and only the lines of the texts that pass are taken, in order.
    wanted = {m for m in dict.fromkeys(messages) if "SXid" in m or "NVSwitch" in m}
    if not wanted:
        return out
    for i, message in enumerate(messages):
        if message in wanted:
            r = records[i]  # type: ignore[index]
            event = parse_sxid(r.message[:_MAX_LINE], r)
            if event is not None:
                out.append(event)
            elif unread is not None and "SXid (" in r.message:  # the driver's form; prose about an SXid is not
                unread.append(r)
    return out


def judge_kernel_records(state: Mapping[str, Any], batch: Any, cfg: Mapping[str, Any], now: float,
                         hold: bool = True) -> Judgement:
    """SXid incidents, one per NVSwitch and SXid code. `batch` is the daemon's KernelBatch (records, gpus,
    boot_id, event_time) or a plain sequence of LogRecords. A fatal incident stands until the boot changes (or
    fatal_hold_s after its last event when that is set); a non-fatal one hold_s after its last event. `hold=False`
    keeps every incident (a post-mortem of a whole file). A line that mentions an SXid in a form not read here is
    UNKNOWN with the line, never silence."""
    records = getattr(batch, "records", batch)
    boot_id = getattr(batch, "boot_id", state.get("boot_id"))
    at_of = getattr(batch, "event_time", None) or (lambda _record: now)
    same_boot = state.get("boot_id") == boot_id
    incidents: dict[str, Any] = json.loads(json.dumps(state.get("incidents", {}))) if same_boot else {}
    unread: dict[str, Any] = json.loads(json.dumps(state.get("unread", {}))) if same_boot else {}
    ignore = set(cfg["ignore_sxids"])
    unreadable: list[LogRecord] = []
    for e in sxid_events_from_records(records, unreadable):
        if e.sxid in ignore:
            continue
        at = at_of(e.record)
        inc = incidents.setdefault(f"{e.pci}|{e.sxid}", {
            "pci": e.pci, "sxid": e.sxid, "switch": e.switch, "events": 0, "fatal": 0, "links": [], "details": [],
            "first_at": at, "first_seq": e.record.seq if e.record else None,
            "first_message": (e.record.message if e.record else e.detail)[:300],
            "source": e.record.source if e.record else None, "first_line": e.record.line if e.record else None})
        inc["last_at"], inc["last_seq"] = max(at, inc.get("last_at", at)), e.record.seq if e.record else None
        if e.fatal is None:  # a detail line of the event before it ("Severity 1 ...", "Data {...}")
            if len(inc["details"]) < 10:
                inc["details"].append(e.detail[:200])
            continue
        inc["events"] += 1
        inc["fatal"] += int(e.fatal)
        inc["last_detail"] = e.detail[:300]
        if e.link is not None and e.link not in inc["links"] and len(inc["links"]) < 64:
            inc["links"].append(e.link)
    unread_lines.note(unread, unreadable, at_of)
    force = set(cfg["fail_sxids"])
    kept, findings, ends = {}, [], []  # ends: when each held incident stops holding
    for key, inc in incidents.items():
        fatal = inc["fatal"] > 0 or inc["sxid"] in force
        hold_s = cfg["fatal_hold_s"] if fatal else cfg["hold_s"]
        if hold and hold_s > 0:
            if now - inc["last_at"] > hold_s:
                continue
            ends.append(inc["last_at"] + hold_s)
        kept[key] = inc
        findings.append(_sxid_finding(inc, fatal))
    new_state: dict[str, Any] = {"boot_id": boot_id, "incidents": kept}
    if unread_lines.standing(unread, now, cfg["hold_s"], hold):
        findings.append(unread_lines.finding(SXID_CHECK_NAME, "sxid-unreadable", "SXid", unread))
        new_state["unread"] = unread
        if (end := unread_lines.ends_at(unread, cfg["hold_s"], hold)) is not None:
            ends.append(end)
    metrics = tuple(MetricSample("gpuwarden_nvswitch_sxid_events", "NVSwitch SXid events seen this boot, per "
                                 "switch and SXid code.", {"pci": i["pci"], "sxid": str(i["sxid"])},
                                 float(i["events"])) for i in kept.values())
    return Judgement(new_state, tuple(findings), metrics, wake_at=min(ends, default=None))


def _sxid_finding(inc: Mapping[str, Any], fatal: bool) -> Finding:
    links = ", ".join(str(n) for n in sorted(inc["links"])) or "not named"
    kind = "fatal" if inc["fatal"] else "non-fatal" if inc["events"] else "severity not stated"
    status, action = (Status.FAIL, Action.DRAIN) if fatal else (Status.WARN, Action.MONITOR)
    then = "drain, then reset the NVSwitch and its GPUs (or reboot)" if fatal else "watch the switch"
    switch = f" ({inc['switch']})" if inc.get("switch") else ""
    last = inc.get("last_detail") or (inc["details"][-1] if inc["details"] else "")
    return Finding(SXID_CHECK_NAME, f"sxid-{inc['sxid']}", Entity("nvswitch", inc["pci"], pci=inc["pci"]), status,
                   f"NVSwitch {inc['pci']}{switch}: SXid {inc['sxid']} ({kind}), link(s) {links}: {inc['events']} "
                   f"event(s), last: \"{last}\"; {then}", action,
                   {k: inc.get(k) for k in ("sxid", "events", "fatal", "links", "details", "source", "first_line",
                                            "first_seq", "last_seq", "first_message")})


def judge_records(records: Iterable[LogRecord]) -> list[Finding]:
    """Every SXid incident in a saved log, judged from a fresh state with the default policy (`analyze`)."""
    return list(judge_kernel_records({}, list(records), CHECK.defaults, 0.0, hold=False).findings)


def analyze_text(text: str, source: str) -> tuple[list[Finding], list[ParseError]]:
    """`gpuwarden analyze` for a kernel or Fabric Manager log: every SXid incident in the file."""
    records, errors = parse_log_text(text, source)
    return judge_records(records), errors


def run(node: Any, cfg: Mapping[str, Any]) -> Iterator[Finding]:
    """Preflight: the boot's kernel log judged from a fresh state, each record at the time it was logged."""
    batch, now = boot_batch(node)  # SourceError propagates: the runner reports UNKNOWN
    yield from judge_kernel_records({}, batch, cfg, now).findings


DEFAULTS = {
    "ignore_sxids": [],  # never reported
    "fail_sxids": [],  # treated as fatal
    "hold_s": 3600.0,  # a non-fatal incident stands this long after its last event
    "fatal_hold_s": 0.0,  # a fatal one: 0 = until the next boot
}

CHECK = CheckSpec(
    name=SXID_CHECK_NAME,
    summary="NVSwitch SXid errors in the kernel log: fatal ones drain, non-fatal ones warn",
    run=run,
    defaults=DEFAULTS,
    list_types={"ignore_sxids": int, "fail_sxids": int},
    timeout_s=30,
)


SXID_CONSUMER = KernelConsumer(
    name=SXID_CHECK_NAME,
    summary=CHECK.summary,
    judge=judge_kernel_records,
    defaults=DEFAULTS,  # the one [checks.nvswitch_sxid] table, read by every form
    list_types=CHECK.list_types,
    interest=("SXid", "NVSwitch"),  # SXid lines and their Severity/Data continuations; Fabric Manager's wording
    quiet=unread_lines.nothing_held,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="nvswitch_sxid", order=20, level="quick", look="CHECK", kernel="SXID_CONSUMER", kernel_order=3,
    analyze=("kernel-log",), doom=("nvswitch-fatal",),
)
