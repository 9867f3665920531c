"""The xid check: NVIDIA XIDs as incidents, one per GPU and XID code, with the action NVIDIA's XID catalogue
recommends (for XID 154, the recovery action the driver names). One decision, three ways:

- the daemon feeds `judge` the followed kernel log and NVML's XID events as they come, the state persisted;
- `preflight` judges the boot's kernel log (or what followed a recovery, for a retest) from a fresh state, each
  record at the time it was logged;
- `analyze` judges a saved log from a fresh state, every incident standing (a post-mortem sees the whole file).

An incident below REBOOT stands `hold_s` after its last event, or until the driver reports the GPU recovered (XID
154 "to 0x0 (None)" after a reset); one that needs a reboot stands for the boot. A line that mentions an XID in a
form not read here is UNKNOWN with the line: an unknown format is never silence.

De-duplication of the two daemon sources: an NVML event has no pid, process, text or time of its own, so single
events cannot be paired. Each incident counts per source, and its count is the larger of the two: an XID seen by
both counts once, one seen only by NVML (no /dev/kmsg in a container) or dropped by printk's rate limit still counts.

What an incident shows (action, finding, samples) is checks/xid_findings.py's; the last judgements kept for reuse are
checks/xid_reuse.py's.
"""
from __future__ import annotations

import heapq
import json
from typing import Any, Callable, Iterator, Mapping, Sequence

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import ParseError, SourceError
from gpuwarden.agent.core.kernel_log import LogRecord, parse_log_text
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, KernelBatch, KernelConsumer, MetricSample, boot_batch
from gpuwarden.checks import unread_lines
from gpuwarden.checks.xid_catalog import XidInfo, load_catalog, recovery_action
from gpuwarden.checks.xid_findings import _SHOWN, CHECK_NAME, _same_entity, _shown
from gpuwarden.checks.xid_log import (
    LoggedGpu,
    XidEvent,
    collect,
    collect_runs,
    entity_lookup,
    parse_gpu_preamble,
    parse_xid,
)
from gpuwarden.checks.xid_reuse import _LAST, _LAST_LOCK, _judge_touched, _keep, _Last

__all__ = ["CHECK", "CONSUMER", "analyze_text", "collect", "decide", "judge", "judge_records",
           "parse_gpu_preamble", "parse_xid", "run"]

_MAX_EVIDENCE = 10
_UNREAD = "xid-unreadable"


def _incident(incidents: dict[str, dict[str, Any]], pci: str, xid: int, source: str, at: float,
              touched: set[str], n: int = 1, latest: float | None = None) -> dict[str, Any]:
    """The incident of (pci, xid) after `n` events from `source`, the first at `at` and the latest at `latest` (`at`
    if None), ready for this batch's changes."""
    # Called once per run of XID lines or NVML event (a flood is millions of them in a saved log): no dict is built
    # for an incident that exists, and what an old state lacks is filled in once, when the incident is copied for the
    # batch.
    key = f"{pci}|{xid}"
    inc = incidents.get(key)
    if inc is None:
        inc = incidents[key] = {"pci": pci, "xid": xid, "count": 0, "first_at": at, "first_seq": None,
                                "first_message": "", "pids": [], "processes": [], "kmsg_count": 0, "nvml_count": 0,
                                "last_at": at, "last_seq": None}
        touched.add(key)
    elif key not in touched:
        # Copied on its first change in this batch, never changed in place: the state judged from stays as it was
        # (judge is pure), and the incidents this batch did not touch stay the same objects, which is what lets the
        # findings of an unchanged incident be reused and the store write only the incidents that changed.
        inc = incidents[key] = {**inc, "pids": list(inc.get("pids", ())), "processes": list(inc.get("processes", ())),
                                **({"mig": list(inc["mig"])} if "mig" in inc else {})}
        # State written before NVML was a source has only "count": every one of those came from the kernel log.
        inc.setdefault("kmsg_count", inc["count"])
        inc.setdefault("nvml_count", 0)
        inc.setdefault("last_at", at)
        inc.setdefault("last_seq", None)
        touched.add(key)
    if source == "kmsg":
        inc["kmsg_count"] += n
    else:
        inc["nvml_count"] += n
    kmsg, nvml = inc["kmsg_count"], inc["nvml_count"]
    inc["count"] = kmsg if kmsg >= nvml else nvml
    latest = at if latest is None else latest
    if latest > inc["last_at"]:
        inc["last_at"] = latest
    return inc


def _take(incidents: dict[str, dict[str, Any]], touched: set[str], latest: dict[tuple[str, int], int],
          e: XidEvent, records: Sequence[LogRecord], at: Sequence[int],
          event_time: Callable[[LogRecord], float] | None, now: float) -> None:
    """Counts the records at `at` (indices into `records`, in order), each a line of the event `e`, onto its incident
    as each in turn would count: what they add is their number, the first and the last of them, their latest time
    and the event's pid, process and MIG instance, so a run of a flood's lines is one step. `latest`: the last line
    taken per incident in this batch (several texts may count onto one incident: the latest line is its last)."""
    first, last = records[at[0]], records[at[-1]]
    if event_time is None:
        when_first = when = now
    else:
        times = [event_time(records[i]) for i in at]
        when_first, when = times[0], max(times)
    inc = _incident(incidents, e.pci, e.xid, "kmsg", when_first, touched, len(at), when)
    if inc["first_seq"] is None and not inc["first_message"]:
        inc["first_seq"] = first.seq
        inc["first_message"] = first.message[:300]
        inc["first_line"] = first.line
        inc["source"] = first.source
        inc["first_time"] = first.timestamp if first.timestamp is not None else first.usec
    key = (e.pci, e.xid)
    if at[-1] > latest.get(key, -1):
        latest[key] = at[-1]
        inc["last_seq"] = last.seq
        inc["last_line"] = last.line
        inc["last_time"] = last.timestamp if last.timestamp is not None else last.usec
        inc["last_detail"] = e.detail[:300]
    if e.pid:
        pids = inc["pids"]
        if len(pids) < _MAX_EVIDENCE and e.pid not in pids:
            pids.append(e.pid)
    if e.process:
        processes = inc["processes"]
        if len(processes) < _MAX_EVIDENCE and e.process not in processes:
            processes.append(e.process)
    if e.gpu_instance is not None:
        tag = f"GI {e.gpu_instance}" + (f" CI {e.compute_instance}" if e.compute_instance is not None else "")
        mig = inc.setdefault("mig", [])
        if tag not in mig and len(mig) < _MAX_EVIDENCE:
            mig.append(tag)



def _recovered(incidents: dict[str, dict[str, Any]], pci: str, catalog: Mapping[int, XidInfo],
               force: set[int]) -> bool:
    """The driver says the GPU needs no recovery any more (XID 154 to None, after a reset): the incidents on it
    that a GPU reset clears are over. What needs a reboot or service, or the operator forces, stands. Returns
    whether any ended."""
    ended = False
    for key, inc in list(incidents.items()):
        if inc["pci"] == pci and inc["xid"] != 154 and inc["xid"] not in force:
            info = catalog.get(int(inc["xid"]))
            if (info.action if info else Action.MONITOR) <= Action.RESET_GPU:
                del incidents[key]
                ended = True
    return ended


def judge(state: Mapping[str, Any], batch: KernelBatch, cfg: Mapping[str, Any], now: float,
          hold: bool = True) -> Judgement:
    """The incidents after `batch`, the findings that hold at `now`, and their metrics. `hold=False` keeps every
    incident (a post-mortem of a whole file)."""
    # Records of an earlier boot are gone with it, and so is every GPU-level fault that a reboot clears.
    same_boot = state.get("boot_id") == batch.boot_id
    incidents: dict[str, dict[str, Any]] = dict(state.get("incidents", {})) if same_boot else {}
    touched: set[str] = set()  # incidents copied for this batch (see _incident)
    uuids: dict[str, str] = dict(state.get("uuids", {})) if same_boot else {}
    unread: dict[str, Any] = json.loads(json.dumps(state.get("unread", {}))) if same_boot else {}  # judge stays pure
    # Whether NVML's events can be watched is news only in NVML's own batches; it outlives a reboot.
    nvml_error = batch.nvml_error if batch.source == "nvml" else state.get("nvml_error")
    ignore, force = set(cfg["ignore_xids"]), set(cfg["fail_xids"])
    catalog = load_catalog()
    at_of = batch.event_time or (lambda _record: now)
    records = batch.records
    runs, logged, unreadable = collect_runs(records)
    uuids.update({g.pci: g.uuid for g in logged})
    event_time = batch.event_time
    runs = [run for run in runs if run.event.xid not in ignore]
    latest: dict[tuple[str, int], int] = {}
    ended = False  # an incident removed by a recovery
    if not any(run.event.xid == 154 and recovery_action(run.event.detail) is Action.NONE for run in runs):
        # Runs of different texts count onto their incidents alike in any order; in the order each text first
        # appears, incidents begin in the order of their first lines.
        for run in runs:
            _take(incidents, touched, latest, run.event, records, run.at, event_time, now)
    else:
        # A recovery ends incidents where it stands in the log: the lines are taken one by one, in order.
        for i, k in sorted((i, k) for k, run in enumerate(runs) for i in run.at):
            e = runs[k].event
            if e.xid == 154 and recovery_action(e.detail) is Action.NONE:
                ended = _recovered(incidents, e.pci, catalog, force) or ended
            _take(incidents, touched, latest, e, records, (i,), event_time, now)
    for x in batch.nvml_xids:
        if x.xid in ignore:
            continue
        # Without an address (NVML's device matched no GPU it listed: rare) the XID still counts, on what is known.
        pci = x.pci or x.uuid or (f"index-{x.gpu}" if x.gpu is not None else "unknown")
        _incident(incidents, pci, x.xid, "nvml", now, touched)
        if x.pci and x.uuid:
            uuids[x.pci] = x.uuid
    unread_lines.note(unread, unreadable, at_of)

    with _LAST_LOCK:
        last = _LAST.pop(id(state), None)  # taken: put back only by a judgement that completes
    if (last is not None and last.state is state and same_boot and not ended and not unread and hold == last.hold
            and (ignore, force, cfg["hold_s"]) == last.cfg and nvml_error == last.nvml_error
            and uuids == last.state["uuids"] and batch.gpus == last.gpus and touched <= last.state["incidents"].keys()):
        quick = _judge_touched(last, incidents, touched, now, catalog, force, cfg["hold_s"])
        if quick is not None:
            _keep(quick)
            return quick.judgement

    entity_at = entity_lookup([*batch.gpus, *(LoggedGpu(uuid, pci) for pci, uuid in uuids.items())])
    xids_on: dict[str, set[int]] = {}
    entities: dict[str, Entity] = {}  # by PCI address: a node has few GPUs and many incidents on each
    shown: dict[int, tuple[Any, ...]] = {}  # what _shown made or reused in this judgement: the next one's cache
    for inc in incidents.values():
        xids_on.setdefault(inc["pci"], set()).add(inc["xid"])
    findings: list[Finding] = []
    metrics: list[MetricSample] = []  # _metrics' order: every incident's gpuwarden_xid_events, then per source
    by_source: list[MetricSample] = []
    kept: dict[str, dict[str, Any]] = {}
    ends: list[float] = []  # when each held incident stops holding
    for key, inc in incidents.items():
        pci = inc["pci"]
        entity = entities.get(pci)
        if entity is None:
            entity = entities[pci] = _same_entity(pci, entity_at(pci))
        action, finding, events_sample, source_samples = _shown(inc, entity, xids_on, catalog, force, shown)
        if hold and action < Action.REBOOT:
            if now - inc["last_at"] > cfg["hold_s"]:
                continue
            ends.append(inc["last_at"] + cfg["hold_s"])
        kept[key] = inc
        findings.append(finding)
        metrics.extend(events_sample)
        by_source.extend(source_samples)
    if unread_lines.standing(unread, now, cfg["hold_s"], hold):
        findings.append(unread_lines.finding(CHECK_NAME, _UNREAD, "XID", unread))
        if (end := unread_lines.ends_at(unread, cfg["hold_s"], hold)) is not None:
            ends.append(end)
    else:
        unread = {}
    if nvml_error:
        findings.append(Finding(CHECK_NAME, "nvml-events", Entity("node", "nvml"), Status.UNKNOWN,
                                f"cannot watch NVML XID events: {nvml_error}; the kernel log is still followed",
                                Action.NONE, {"nvml_error": nvml_error}))
    new_state: dict[str, Any] = {"boot_id": batch.boot_id, "incidents": kept, "uuids": uuids}
    if unread:
        new_state["unread"] = unread
    if nvml_error:
        new_state["nvml_error"] = nvml_error
    _SHOWN[0] = shown  # the incidents of this judgement only: older copies are not kept alive
    judgement = Judgement(new_state, tuple(findings), (*metrics, *by_source), wake_at=min(ends, default=None))
    # Reused by the next judgement only when every incident stands: the findings of those that stand were made with
    # the XIDs on their GPU counting one that has just ended (the XID 45 rule), which a judgement of the state made
    # here would not count.
    if not unread and len(kept) == len(incidents):
        held = {key: inc["last_at"] for key, inc in kept.items() if hold and shown[id(inc)][2][0] < Action.REBOOT}
        heap = [(at, key) for key, at in held.items()]
        heapq.heapify(heap)
        _keep(_Last(new_state, judgement, hold, (ignore, force, cfg["hold_s"]), nvml_error, list(batch.gpus),
                              entities, xids_on, {key: i for i, key in enumerate(kept)}, held, heap, shown))
    return judgement


# -- the fresh-state modes: preflight and analyze -----------------------------------------------------------------
def decide(events: Sequence[XidEvent], gpus: Sequence[Any], catalog: Mapping[int, XidInfo] | None,
           policy: Mapping[str, Any]) -> list[Finding]:
    """The findings of `events` judged from a fresh state with every incident standing, in order of first
    appearance (what `analyze` reports for a file)."""
    del catalog  # the bundled catalogue is the one judge() reads
    records = [e.record or LogRecord(_xid_text(e), 0, "-") for e in events]
    batch = KernelBatch(records, list(gpus), None)
    return list(judge({}, batch, {"hold_s": 0.0, **policy}, 0.0, hold=False).findings)


def _xid_text(e: XidEvent) -> str:
    return f"NVRM: Xid (PCI:{e.pci}): {e.xid}, {e.detail}"


def run(node: Any, cfg: Mapping[str, Any]) -> Iterator[Finding]:
    try:
        # node.gpus(): NVML's list with the PCI/UUID of a lost GPU filled in from sysfs and the driver.
        gpus = list(node.gpus())
    except SourceError:
        gpus = []  # the XIDs still count, keyed by the PCI address the driver printed
    batch, now = boot_batch(node, gpus)  # SourceError propagates: the runner reports UNKNOWN
    yield from judge({}, batch, cfg, now).findings


def judge_records(records: Sequence[LogRecord], gpus: Sequence[Any] = ()) -> list[Finding]:
    """Every XID incident in a saved log, judged from a fresh state with the default policy (`analyze`)."""
    return list(judge({}, KernelBatch(list(records), list(gpus), None), CHECK.defaults, 0.0, hold=False).findings)


def analyze_text(text: str, source: str, gpus: Sequence[Any] = ()) -> tuple[list[Finding], list[ParseError]]:
    """`gpuwarden analyze FILE` for a kernel log: every XID incident in the file, judged as the daemon would."""
    records, errors = parse_log_text(text, source)
    return judge_records(records, gpus), errors


DEFAULTS = {
    "ignore_xids": [],  # never reported (e.g. [43] on a cluster that sees it from user apps)
    "fail_xids": [],  # always treated as a node fault (at least DRAIN)
    "hold_s": 3600.0,  # an incident below REBOOT stands this long after its last event (or until recovered)
}

CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="NVIDIA XID errors in the kernel log (and NVML's XID events in the daemon), with the action NVIDIA's "
            "XID catalogue recommends",
    run=run,
    defaults=DEFAULTS,
    list_types={"ignore_xids": int, "fail_xids": int},
    timeout_s=30,
)

CONSUMER = KernelConsumer(
    name=CHECK_NAME,
    summary=CHECK.summary,
    judge=judge,
    defaults=DEFAULTS,  # the one [checks.xid] table, read by every form
    list_types=CHECK.list_types,
    # XID lines (read or not: an unreadable one is reported) and the driver's "GPU at PCI" lines that name the GPU;
    # not every "NVRM: " line: a GSP timeout's stack dump is hundreds of those, and none says more to this check.
    # "Xid" rather than "NVRM: Xid": it holds nvswitch_sxid's "SXid" too, so one search finds the lines of both.
    interest=("Xid", "NVRM: GPU at "),
    quiet=unread_lines.nothing_held,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="xid", order=10, level="quick", look="CHECK", kernel="CONSUMER", kernel_order=1, analyze=("kernel-log",),
    doom=("xid",),
)
