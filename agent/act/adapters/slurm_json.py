"""What `sinfo --json` and `squeue --json` say, read across Slurm's versions: 22.05's plain values and
comma-separated lists, 23.x's state lists and {"set", "infinite", "number"} numbers, and the "errors" entry 22.05
prints with exit status 0 when it could not ask slurmctld (Transient, never an empty cluster). Also the NVLink domain
the adapter keeps in a node's Extra, which slurmctld keeps across a restart."""
from __future__ import annotations

import json
import math
from typing import Any

from gpuwarden.agent.act.adapters.slurm_hostlist import MAX_DOMAIN, MAX_HOSTLIST, MAX_NAME, expand_hostlist, valid_name
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import REASON_PREFIX, SPARE_REASON, JobView, NodeView, Service, Transient

QUARANTINE_PREFIX = f"{REASON_PREFIX} quarantine:"  # a drain the agent holds for recovery
DOMAIN_FEATURE_PREFIX = "gpuwarden_domain_"  # node feature naming the node's NVLink domain
EXTRA_KEY = "gpuwarden_domain"  # the same domain in the node's Extra, which slurmctld keeps across a restart
MAX_OUTPUT = 64 << 20  # sinfo --json of a 10,000-node cluster is ~20 MiB
MAX_NODES = 1_000_000
MAX_EXTRA = 64 << 10  # a node's Extra longer than this is not read, and not written over
# slurmctld's own reason when it marks a node DOWN for not answering; it clears it itself when the node is back, so a
# drain of ours may replace it (and must: the node has to stay out when it answers again).
SLURM_NOT_RESPONDING = "Not responding"


@dataclass(frozen=True)
class _Node:
    """A node as sinfo --json gives it, with what the NodeView leaves out."""
    view: NodeView
    drain: bool  # the DRAIN flag
    held: bool  # out of service by someone's hand: DRAIN, or DOWN (a NOT_RESPONDING node alone is not)
    responding: bool  # not DOWN, not NOT_RESPONDING, not UNKNOWN
    available: tuple[str, ...]  # AvailableFeatures
    active: tuple[str, ...]  # ActiveFeatures
    comment: str
    extra: str | None  # Extra, as slurmctld has it (None: longer than MAX_EXTRA)


def ours(reason: str | None) -> bool:
    return bool(reason) and reason.startswith(REASON_PREFIX)


def slurm_number(value: Any) -> float | None:
    """A number of sinfo --json: a plain int (22.05) or {"set": bool, "infinite": bool, "number": n} (23.x)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0 < value < 1e11 else None


def _text(value: Any, limit: int = 4096) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _features(value: Any) -> tuple[str, ...]:
    """A feature list: "a,b" (22.05) or ["a", "b"] (newer)."""
    if isinstance(value, str):
        items = value[:65536].split(",")
    elif isinstance(value, list):
        items = [v for v in value[:4096] if isinstance(v, str)]
    else:
        return ()
    return tuple(f for f in (i.strip()[:256] for i in items) if f and f != "(null)")


def _state_words(entry: dict) -> set[str]:
    """The base state and its flags in upper case: 22.05 gives "state": "idle" plus "state_flags": ["DRAIN"],
    23.02 and newer "state": ["IDLE", "DRAIN"]."""
    words: set[str] = set()
    for key in ("state", "state_flags"):
        value = entry.get(key)
        for item in ([value] if isinstance(value, str) else value if isinstance(value, list) else [])[:64]:
            if isinstance(item, str):
                words.update(w for w in item[:256].upper().replace("+", " ").split() if w)
    return words


def _service(words: set[str], drain: bool) -> tuple[Service, bool]:
    """(Service, responding) from the state words."""
    busy = bool(words & {"ALLOCATED", "MIXED", "COMPLETING"})
    if "NOT_RESPONDING" in words or "DOWN" in words:
        return Service.DOWN, False
    if drain:
        return (Service.CORDONED if busy else Service.DRAINED), True
    if words & {"IDLE", "ALLOCATED", "MIXED", "COMPLETING"}:
        return Service.IN_SERVICE, True
    return Service.UNKNOWN, False  # UNKNOWN (slurmctld just started, node not registered yet), FUTURE, ERROR


def _json_object(text: str) -> dict | None:
    """`text` as a JSON object, when it is one (an Extra written for Slurm 23.02's extra constraints)."""
    if not text.startswith("{") or len(text) > MAX_EXTRA:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def extra_domain(extra: str) -> tuple[str | None, str]:
    """(the domain stored in a node's Extra, the operator's own Extra). Ours is `gpuwarden_domain=<domain>` at the
    start, the operator's text after `; `; or, in an Extra that is a JSON object, its key `gpuwarden_domain`."""
    extra = extra.strip()
    obj = _json_object(extra)
    if obj is not None:
        value = obj.pop(EXTRA_KEY, None)
        rest = json.dumps(obj) if obj else ""
        return (value if valid_name(value, MAX_DOMAIN) else None), rest
    if not extra.startswith(EXTRA_KEY + "="):
        return None, extra
    head, _, rest = extra[len(EXTRA_KEY) + 1:].partition(";")
    name = head.strip()
    return (name if valid_name(name, MAX_DOMAIN) else None), rest.strip()


def extra_with_domain(extra: str, domain: str) -> str:
    """The Extra that stores `domain` and keeps the operator's own text (inside it when that is a JSON object)."""
    _, rest = extra_domain(extra)
    obj = _json_object(rest) if rest else None
    if obj is not None:
        return json.dumps({**obj, EXTRA_KEY: domain})
    return f"{EXTRA_KEY}={domain}; {rest}" if rest else f"{EXTRA_KEY}={domain}"


def _json_document(text: str, tool: str) -> dict:
    """The document of `<tool> --json`, bounded in size. Transient for what is not one, and for the "errors" entry
    22.05's sinfo and squeue print (exit status 0, an empty list) when they could not ask slurmctld."""
    if len(text) > MAX_OUTPUT:
        raise Transient(f"{tool} --json: more than {MAX_OUTPUT >> 20} MiB; not read")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Transient(f"{tool} --json: not JSON ({str(exc)[:100]})") from None
    if not isinstance(doc, dict):
        raise Transient(f"{tool} --json: not a JSON object")
    errors = doc.get("errors")
    if isinstance(errors, list) and errors:
        first = errors[0] if isinstance(errors[0], dict) else {}
        what = _text(first.get("error") or first.get("description"), 200) or "error"
        raise Transient(f"{tool} --json: slurmctld not reached ({what}, {len(errors)} error(s))")
    return doc


def parse_sinfo_json(text: str) -> list[_Node]:
    """Every node of `sinfo --json`. Raises Transient when sinfo says it could not ask slurmctld (22.05 prints an
    empty node list with an "errors" entry and exits 0), Refused on a document that is not sinfo's."""
    doc = _json_document(text, "sinfo")
    entries = doc.get("nodes")
    if not isinstance(entries, list) or len(entries) > MAX_NODES:
        raise Transient("sinfo --json: no node list")
    nodes: dict[str, _Node] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not valid_name(entry.get("name"), MAX_NAME):
            continue
        name = entry["name"]
        words = _state_words(entry)
        drain = "DRAIN" in words
        service, responding = _service(words, drain)
        reason = _text(entry.get("reason"), 1024) or None
        available, active = _features(entry.get("features")), _features(entry.get("active_features"))
        domains = sorted(f[len(DOMAIN_FEATURE_PREFIX):] for f in available if f.startswith(DOMAIN_FEATURE_PREFIX))
        extra = _text(entry.get("extra"), MAX_EXTRA + 1)
        extra = extra if len(extra) <= MAX_EXTRA else None
        if not domains and extra:  # the feature is gone after a slurmctld restart until the next publish; Extra is kept
            stored = extra_domain(extra)[0]
            domains = [stored] if stored else []
        idle = "IDLE" in words and not words & {"ALLOCATED", "MIXED", "COMPLETING"}
        view = NodeView(
            name=name, service=service, reason=reason,
            reason_since=slurm_number(entry.get("reason_changed_at")) if reason else None,
            ours=ours(reason), quarantined=bool(reason) and reason.startswith(QUARANTINE_PREFIX),
            domain=domains[0] if domains else None, spare=reason == SPARE_REASON,
            jobs=0 if idle else None)
        held = drain or "DOWN" in words
        nodes[name] = _Node(view, drain, held, responding, available, active, _text(entry.get("comment"), 4096),
                            extra)
    return list(nodes.values())


def job_state_words(value: Any) -> list[str]:
    """A job state: "RUNNING" (22.05) or ["RUNNING", ...] (newer)."""
    items = [value] if isinstance(value, str) else value[:16] if isinstance(value, list) else []
    return [w for i in items if isinstance(i, str) for w in i[:64].upper().split()]


def slurm_flag(value: Any, default: Any) -> Any:
    """A flag of squeue --json: a plain bool (22.05) or {"set", "number"} (newer); `default` for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, dict) and isinstance(value.get("number"), (int, bool)):  # {"set":..,"number":..} shapes
        return bool(value["number"])
    return default


# squeue's job states (squeue(1) "JOB STATE CODES") as the job response reads them.
_JOB_STATES = {"RUNNING": "running", "CONFIGURING": "running", "RESIZING": "running", "PENDING": "pending",
               "REQUEUED": "pending", "REQUEUE_HOLD": "pending", "REQUEUE_FED": "pending", "RESV_DEL_HOLD": "pending",
               "SUSPENDED": "suspended", "STOPPED": "suspended", "COMPLETING": "ending", "SIGNALING": "ending",
               "STAGE_OUT": "ending", "COMPLETED": "ended", "CANCELLED": "ended", "FAILED": "ended",
               "TIMEOUT": "ended", "NODE_FAIL": "ended", "PREEMPTED": "ended", "BOOT_FAIL": "ended",
               "DEADLINE": "ended", "OUT_OF_MEMORY": "ended", "REVOKED": "ended", "SPECIAL_EXIT": "ended"}


def parse_squeue_job(text: str, job_id: str) -> JobView | None:
    """The job `job_id` of `squeue --json --jobs=ID` (22.05: plain values; 23.x: state lists and {"number"} values);
    None when squeue lists no such job (slurmctld answered: an error entry is Transient)."""
    jobs = _json_document(text, "squeue").get("jobs")
    if not isinstance(jobs, list):
        raise Transient("squeue --json: no job list")
    for entry in jobs[:10_000]:
        jid = slurm_number(entry.get("job_id")) if isinstance(entry, dict) else None
        if jid is None or str(int(jid)) != job_id:
            continue
        state = next((_JOB_STATES[w] for w in job_state_words(entry.get("job_state")) if w in _JOB_STATES), "unknown")
        try:
            nodes = tuple(expand_hostlist(_text(entry.get("nodes"), MAX_HOSTLIST)))
        except ValueError:
            nodes = ()  # not a node list: where it runs is not said (the run and the state still decide)
        return JobView(job_id, state, nodes, _count(entry.get("restart_cnt")), slurm_flag(entry.get("requeue"), None),
                       _text(entry.get("admin_comment"), 4096) or None)
    return None


def _count(value: Any) -> int | None:
    """A count of squeue --json (0 included, which slurm_number leaves out): plain or {"set", "number"}."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) and not value.get("infinite") else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31 else None
