"""What one node's gpuwarden knew over a time window, as one JSON document (schema 1): the findings that stood in
[since, until], the node state's transitions and the job intents made in it. The daemon serves it on its endpoint
(`GET /api/v1/findings`); `gpuwarden explain --evidence DIR` builds the same document from a saved store or a
recording (`gpuwarden record`). Pure apart from reading the store or the recording.

Which findings are in the window, from what the store really keeps:
- the store holds each check's *current* findings only (agent/state/store.py: one record per check, written whenever its
  status, findings or durable state change, `updated` the time of that write); a finding that ended is gone from
  it, and survives only as the reason of a transition or in an intent's detail (both listed here by their time).
  So every finding listed stands from when it began until the store's last sign of life ("watched until": now for
  the running daemon, else the latest time written anywhere in the store);
- a finding whose start the check's state keeps (the xid and nvswitch_sxid incidents' wall-clock `first_at` /
  `last_at`, an IB port's `down_since` and down intervals, a thermal run's `since`, a fabric GPU's
  `not_ready_since`) is in when that span, [first_at, watched until], meets [since, until]: it began no later than
  `until`, and the store watched on to `since` or later. A window that ends before an XID does not hold it;
- a finding whose start is not known (first_at null) is in whenever the store watched on to `since` or later: its
  record was current in or after the window, and the store cannot say when it began. Leaving it out would hide a
  fault that may have stood throughout (an uncorrectable ECC count that moved after the job ended rewrites the
  record with a later time); each finding carries `recorded_at`, its record's time, so a reader can tell one that
  stood through the window (recorded_at <= since) from one first written after it (recorded_at > until).
Transitions are in by `at`, job intents by `created`. Every list is bounded (`limit`, the newest kept);
`truncated` says something was cut, and a store whose history is longer than what is read back (SCAN_LIMIT) says so.
"""
from __future__ import annotations

import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.model import Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs.respond import JOB_ACTION
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import NodeRecord, Transition

SCHEMA = 1
DEFAULT_LIMIT = 1000  # items per list: a node's document stays a few MB at most
SCAN_LIMIT = 20000  # transitions and intents read back from the newest (a node makes a few a day)
MAX_WINDOW_S = 31 * 86400.0  # the longest window the endpoint answers: a job's, not a node's lifetime
READ_BUSY_S = 2.0  # a read waits this long at most on a database a writer holds (WAL: rarely at all)


class EvidenceError(GpuwardenError):
    """A window that cannot be built (a path that is neither a store nor a recording, a bad time)."""


@dataclass(frozen=True)
class Snapshot:
    """What a store or a recording holds, read once."""

    node: str
    record: NodeRecord | None
    checks: tuple[CheckRecord, ...]
    transitions: tuple[Transition, ...]  # newest first
    intents: tuple[Mapping[str, Any], ...]  # oldest first
    watched_until: float | None  # the source's last sign of life; None: watching now (the running daemon)
    complete: bool = True  # transitions and intents hold the whole history (not cut at SCAN_LIMIT)


# -- times -------------------------------------------------------------------------------------------------------
def parse_time(text: str) -> float:
    """A Unix time ("1733472000", "1733472000.5") or an RFC 3339 / ISO 8601 time with a zone
    ("2026-12-06T11:59:30Z", "2026-12-06T12:59:30+01:00") as a Unix time. Raises ValueError saying why."""
    text = text.strip()
    if not text:
        raise ValueError("empty time")
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{text!r} is not a time")
        return value
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a Unix time nor an RFC 3339 time") from None
    if when.tzinfo is None:
        raise ValueError(f"{text!r} has no zone (add Z or an offset such as +01:00)")
    return when.timestamp()


def window_problem(since: float, until: float) -> str | None:
    """Why [since, until] is not a window the endpoint answers, or None."""
    if since > until:
        return "since is after until"
    if until - since > MAX_WINDOW_S:
        return f"window longer than {MAX_WINDOW_S / 86400:.0f} days"
    return None


# -- the document ------------------------------------------------------------------------------------------------
def window(store: Store, since: float, until: float, *, limit: int = DEFAULT_LIMIT, node: str | None = None,
           live: bool = False, now: float | None = None) -> dict[str, Any]:
    """The window document of a store (read only). `live`: the store's daemon is running now (the endpoint), so
    its records stand until now; else they stand until the latest time written in the store. `node`: the node's
    name (default: the scheduler name the store's remediation status keeps). Raises StoreError naming the file."""
    return document(read_store(store, node, live), since, until, limit=limit, now=now)


def serving(db: Path, node: str, *, limit: int = DEFAULT_LIMIT) -> Callable[[float, float], dict[str, Any]]:
    """The running daemon's window, for its endpoint: each call opens the store read only on a connection of its
    own, reads and closes it. The daemon's connection and its lock are never taken, and in WAL mode a reader does
    not wait on the writer (nor the writer on it): a request never holds up a check's commit. The records stand
    until now (the daemon is running)."""
    def read(since: float, until: float) -> dict[str, Any]:
        store = Store(db, readonly=True, busy_timeout_s=READ_BUSY_S)
        try:
            return window(store, since, until, limit=limit, node=node, live=True)
        finally:
            store.close()

    return read


def read_store(store: Store, node: str | None = None, live: bool = False) -> Snapshot:
    """A store read once (StoreError naming the file when it cannot be read)."""
    record, checks = store.node(), tuple(store.checks())
    transitions = tuple(store.transitions(limit=SCAN_LIMIT))
    intents = tuple(store.intents(limit=SCAN_LIMIT))
    if node is None:
        status = store.meta("remediation")
        node = str(status.get("node_name") or "") if isinstance(status, dict) else ""
    complete = len(transitions) < SCAN_LIMIT and len(intents) < SCAN_LIMIT
    watched = None if live else _last_written(record, checks, transitions, intents)
    return Snapshot(node, record, checks, transitions, intents, watched, complete)


def _last_written(record: NodeRecord | None, checks: Iterable[CheckRecord], transitions: Iterable[Transition],
                  intents: Iterable[Mapping[str, Any]]) -> float:
    times = [c.updated for c in checks] + [t.at for t in transitions]
    times += [t for i in intents for t in (i.get("created"), i.get("done")) if isinstance(t, (int, float))]
    if record is not None:
        times += [t for t in (record.since, record.fault_since, record.clear_since, record.step_since) if t]
    return max((t for t in times if math.isfinite(t)), default=0.0)


def document(snap: Snapshot, since: float, until: float, *, limit: int = DEFAULT_LIMIT,
             now: float | None = None) -> dict[str, Any]:
    """The window document of a snapshot (pure)."""
    now = time.time() if now is None else now
    limit = max(0, int(limit))
    watched = now if snap.watched_until is None else snap.watched_until
    covers = watched >= since  # the source watched on into the window (or past it)
    findings: list[dict[str, Any]] = []
    unknown: list[dict[str, Any]] = []
    for rec in snap.checks if covers else ():
        spans = _Spans(rec)
        for f in rec.findings:
            first, last = spans.of(f)
            if first is not None and first > until:
                continue  # began after the window
            findings.append(finding_dict(f, first, last, rec.updated))
        if rec.status is Status.UNKNOWN and rec.error:
            unknown.append({"check": rec.name, "error": rec.error, "recorded_at": rec.updated})
    transitions = [{"at": t.at, "from": t.frm.value, "to": t.to.value, "reason": t.reason, "actions": list(t.actions)}
                   for t in reversed(snap.transitions) if since <= t.at <= until]
    jobs = [{"key": i["key"], "action": i["action"], "created": i["created"], "done": i.get("done"),
             "outcome": i.get("outcome"), "detail": i.get("detail", {})}
            for i in snap.intents if i.get("action") == JOB_ACTION and since <= i["created"] <= until]
    findings.sort(key=lambda f: (f["first_at"] if f["first_at"] is not None else f["recorded_at"]))
    cut = [len(findings) > limit, len(unknown) > limit, len(transitions) > limit, len(jobs) > limit]
    oldest = snap.transitions[-1].at if snap.transitions else None
    history_cut = not snap.complete and (oldest is None or oldest > since)
    record = snap.record
    return _finite({
        "schema": SCHEMA, "node": snap.node, "since": since, "until": until, "generated_at": now,
        "watched_until": snap.watched_until,
        "state": ({"state": record.state.value, "since": record.since, "reason": record.reason}
                  if record is not None else None),
        "findings": _newest(findings, limit), "unknown": _newest(unknown, limit),
        "transitions": _newest(transitions, limit), "jobs": _newest(jobs, limit),
        "truncated": any(cut) or history_cut,
    })


def finding_dict(f: Finding, first_at: float | None, last_at: float | None, recorded_at: float) -> dict[str, Any]:
    e = f.entity
    return {"check": f.check, "code": f.code, "status": f.status.name, "action": f.action.name,
            "message": f.message, "entity": {"kind": e.kind, "id": e.id, "index": e.index, "pci": e.pci,
                                             "link": e.link},
            "evidence": dict(f.evidence), "first_at": first_at, "last_at": last_at, "recorded_at": recorded_at}


def _newest(items: list[Any], limit: int) -> list[Any]:
    return items[len(items) - limit:] if len(items) > limit else items


def _finite(value: Any) -> Any:
    """JSON has no infinity or NaN (a store's evidence may hold one: json.dumps writes them): null instead."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _Spans:
    """The span [first_at, last_at] (wall clock) of each finding of one check, from what its state keeps; (None,
    None) where it keeps none. Reads the state as the check writes it, and anything else as not known."""

    def __init__(self, rec: CheckRecord):
        self.rec = rec
        state = rec.state if isinstance(rec.state, dict) else {}
        incidents = state.get("incidents") if isinstance(state.get("incidents"), dict) else {}
        self._incidents: dict[tuple[str, str], Mapping[str, Any]] = {}
        for inc in incidents.values():
            if isinstance(inc, dict) and "pci" in inc:
                code = f"sxid-{inc['sxid']}" if "sxid" in inc else str(inc.get("xid"))
                self._incidents[(code, str(inc["pci"]))] = inc
        self._unread = state.get("unread") if isinstance(state.get("unread"), dict) else {}
        self._ports = state.get("ports") if isinstance(state.get("ports"), dict) else {}
        self._not_ready = state.get("not_ready_since") if isinstance(state.get("not_ready_since"), dict) else {}

    def of(self, f: Finding) -> tuple[float | None, float | None]:
        try:
            first, last = self._span(f)
        except (KeyError, TypeError, ValueError, IndexError):
            return None, None  # a state of another shape (an older version): not known
        return (_time(first), _time(last)) if _time(first) is not None else (None, None)

    def _span(self, f: Finding) -> tuple[Any, Any]:
        if self.rec.name in ("xid", "nvswitch_sxid"):
            if f.code.endswith("-unreadable") and self._unread:
                return self._unread.get("first_at", self._unread.get("last_at")), self._unread.get("last_at")
            inc = self._incidents.get((f.code, str(f.entity.pci))) or self._incidents.get((f.code, f.entity.id))
            return (inc.get("first_at"), inc.get("last_at")) if inc else (None, None)
        if self.rec.name == "ib_port" and f.entity.id in self._ports:
            port = self._ports[f.entity.id]
            starts = [i[0] for i in port.get("intervals", ())]
            ends = [i[1] for i in port.get("intervals", ())]
            if port.get("down_since") is not None:
                return min([port["down_since"], *starts]), port.get("t")
            return (min(starts), max(ends)) if starts else (None, None)
        if self.rec.name == "fabric" and f.entity.id in self._not_ready:
            return self._not_ready[f.entity.id], self.rec.updated
        since = f.evidence.get("since") if self.rec.name == "thermal" else None
        return (since, self.rec.updated) if since is not None else (None, None)


def _time(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
