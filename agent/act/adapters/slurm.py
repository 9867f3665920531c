"""The Slurm adapter: carries the engine's decisions to slurmctld with `scontrol`, reads the fleet back with
`sinfo --json` (and `squeue` for one node's jobs), Slurm 22.05 and newer.

What it writes, and so what it owns:
- a node's Reason (drain): `gpuwarden: <finding>`, `gpuwarden: quarantine: <finding>`, or SPARE_REASON for a
  spare held out of service. Only a node drained with a reason that starts with REASON_PREFIX is ever resumed;
  an administrator's or NHC's drain is never undone (`Refused`), and never overwritten.
- a node feature `gpuwarden_domain_<domain>` (the NVLink domain, what users select with --constraint), and the
  same domain in the node's Extra (`gpuwarden_domain=<domain>`, an operator's own Extra kept after it): features
  set by scontrol are forgotten when slurmctld restarts, Extra is kept in its saved state, so the domain (and with
  it the spare pool) is known at once after a restart, and the next publish puts the feature back.
- while taking a spare: a reservation `gpuwarden_spare_<spare>_for_<failed node>` as the claim (slurmctld refuses
  a reservation that overlaps another on the same node, so two agents never take the same spare; the name says
  whose claim it is, so a retried take carries on with its own), and the spare's Comment
  `gpuwarden: spare for <node>` so a retried take returns the spare already taken.
docs/slurm.md explains each choice and the 22.05 behaviours handled here."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import (
    REASON_PREFIX,
    SPARE_REASON,
    Busy,
    JobView,
    NodeView,
    Refused,
    Service,
    Transient,
)

log = logs.get_logger("gpuwarden.adapter.slurm")

QUARANTINE_PREFIX = f"{REASON_PREFIX} quarantine:"  # a drain the agent holds for recovery
DOMAIN_FEATURE_PREFIX = "gpuwarden_domain_"  # node feature naming the node's NVLink domain
EXTRA_KEY = "gpuwarden_domain"  # the same domain in the node's Extra, which slurmctld keeps across a restart
CLAIM_PREFIX = "gpuwarden_spare_"  # reservation name: the exclusive claim on one spare while it is taken ...
CLAIM_FOR = "_for_"  # ... and the failed node it is taken for: `gpuwarden_spare_<spare>_for_<node>`
RECORD_PREFIX = f"{REASON_PREFIX} spare for "  # the taken spare's Comment: which failed node it replaces
MAX_REASON = 200  # characters of a reason the adapter writes (the finding is cut to fit)
MAX_NAME = 64  # a node name longer than this is not one (hostnames: 63)
MAX_DOMAIN = 100
MAX_OUTPUT = 64 << 20  # sinfo --json of a 10,000-node cluster is ~20 MiB
MAX_STDERR = 64 << 10
MAX_NODES = 1_000_000
MAX_EXTRA = 64 << 10  # a node's Extra longer than this is not read, and not written over
MAX_RESERVATIONS = 100_000
# slurmctld's own reason when it marks a node DOWN for not answering; it clears it itself when the node is back, so a
# drain of ours may replace it (and must: the node has to stay out when it answers again).
SLURM_NOT_RESPONDING = "Not responding"

# scontrol/sinfo messages that mean "slurmctld could not be asked" (retry later) ...
_TRANSIENT = ("unable to contact slurm controller", "connection refused", "connect failure", "socket timed out",
              "timed out", "not responding", "zero bytes were transmitted", "temporarily unavailable",
              "try again", "standby mode", "communication", "configuration source", "slurmctld is down",
              "unspecified error")
# ... and those that mean slurmctld answered no.
_REFUSED = ("invalid", "permission denied", "access denied", "duplicate reservation name", "overlaps",
            "not found", "busy", "not subset", "does not exist", "unknown", "not allowed", "requested nodes",
            "presently disabled")
_CLAIM_TAKEN = ("duplicate reservation name", "overlaps", "busy")


class _ClaimTaken(Refused):
    """Another agent holds the claim on this spare."""


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


def valid_name(name: Any, limit: int) -> bool:
    """A single Slurm name: letters, digits, `.`, `_`, `-` (no hostlist: `n[1-9]` or `a,b` would name many)."""
    return (isinstance(name, str) and 0 < len(name) <= limit and name[0] != "-"
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in name))


def _check_node(node: str) -> str:
    if not valid_name(node, MAX_NAME):
        raise Refused(f"{node!r}: not a single Slurm node name (letters, digits, '.', '_', '-')")
    return node


def _check_domain(domain: str) -> str:
    if not valid_name(domain, MAX_DOMAIN):
        raise Refused(f"{domain!r}: not usable as a node feature (letters, digits, '.', '_', '-'; at most "
                      f"{MAX_DOMAIN})")
    return domain


def _clean(text: str) -> str:
    """Printable ASCII with single spaces: no quotes, backslashes or control characters, which scontrol's own
    parser, `scontrol show node` readers and sinfo format strings would take apart."""
    out = [c if ("!" <= c <= "~" and c not in "\"'\\`") else " " for c in text[: 4 * MAX_REASON]]
    return " ".join("".join(out).split())


def reason_text(reason: str, quarantine: bool = False) -> str:
    """The Reason the adapter writes for `reason`: REASON_PREFIX, `quarantine:` when held for recovery, the
    finding cleaned and cut to MAX_REASON characters."""
    body = _clean(reason)
    if body.startswith(REASON_PREFIX):
        body = body[len(REASON_PREFIX):].lstrip()
    if body.startswith("quarantine:"):
        body = body[len("quarantine:"):].lstrip()
    head = QUARANTINE_PREFIX if quarantine else REASON_PREFIX
    body = body or ("held for recovery" if quarantine else "drained")
    return f"{head} {body}"[:MAX_REASON].rstrip()


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


def claim_name(spare: str, for_node: str) -> str:
    """The claim reservation on `spare` while it is taken for `for_node`: the name says whose claim it is."""
    return f"{CLAIM_PREFIX}{spare}{CLAIM_FOR}{for_node}"


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


def _record_of(comment: str) -> tuple[str | None, str]:
    """(the failed node a taken spare stands in for, the rest of the Comment) from a Comment."""
    if not comment.startswith(RECORD_PREFIX):
        return None, comment
    head, sep, rest = comment[len(RECORD_PREFIX):].partition(";")
    name = head.strip()
    return (name if valid_name(name, MAX_NAME) else None), rest.strip() if sep else ""


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


MAX_HOSTS = 100_000  # names one hostlist may stand for (a job on more nodes than this is not one)
MAX_HOSTLIST = 1 << 20  # characters of one hostlist


# -- hostlists (squeue's node lists) -----------------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at {i}")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' at {i}")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' not closed")
    parts.append(text[start:])
    return parts


def _ranges(body: str, limit: int) -> tuple[list[tuple[int, int, int]], int]:
    """The ranges of one bracket (`1-3,5,07-09`): (low, high, width) each, and how many numbers they hold."""
    out, count = [], 0
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        hi = hi if dash else lo
        if not (lo.isascii() and lo.isdigit() and hi.isascii() and hi.isdigit()) or len(lo) > 9 or len(hi) > 9:
            raise ValueError(f"bad range {item!r}")
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"range {item!r} runs backwards")
        count += b - a + 1
        if count > limit:
            raise ValueError(f"stands for more than {limit} names")
        out.append((a, b, len(lo) if len(lo) > 1 and lo[0] == "0" else 0))
    return out, count


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """The node names of a Slurm hostlist as `scontrol show hostnames` gives them: `n[1-3,5]`, `a,b`, `n[01-03]`,
    `r[1-2]n[1-2]` (each bracket a factor, left to right). The count is known before any name is made, so a short
    hostile list (`n[0-999999999]`) is refused, not expanded; the work is linear in the text and the names. Raises
    ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError("not a string")
    if len(text) > MAX_HOSTLIST:
        raise ValueError(f"longer than {MAX_HOSTLIST} characters")
    text = text.strip()
    if not text:
        return []
    names: list[str] = []
    for entry in _split_top(text):
        if not entry:
            raise ValueError("empty name between commas")
        # prefix [r] literal [r] ... ; Slurm refuses text after the last bracket, so does this
        pieces: list[Any] = []
        rest, total = entry, 1
        while "[" in rest:
            head, _, tail = rest.partition("[")
            body, close, rest = tail.partition("]")
            if not close:
                raise ValueError(f"{entry!r}: '[' not closed")
            ranges, count = _ranges(body, limit)
            total *= count
            if total + len(names) > limit:
                raise ValueError(f"stands for more than {limit} names")
            pieces += [head, ranges]
        if rest and pieces:
            raise ValueError(f"{entry!r}: text after the last ']'")
        pieces.append(rest)
        expanded = [""]
        for piece in pieces:
            if isinstance(piece, str):
                expanded = [e + piece for e in expanded]
            else:
                expanded = [e + str(n).zfill(w) for e in expanded for a, b, w in piece for n in range(a, b + 1)]
        for name in expanded:
            if not valid_name(name, MAX_NAME):
                raise ValueError(f"{name[:80]!r}: not a node name")
        names += expanded
    return names


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


def _check_job(job: Any) -> str:
    ident = str(getattr(job, "id", ""))
    if getattr(job, "scheduler", "") != "slurm" or not ident.isdigit() or len(ident) > 12:
        raise Refused(f"{ident!r}: not a Slurm job id")
    return ident


def _classify(what: str, message: str) -> Exception:
    low = message.lower()
    if any(m in low for m in _TRANSIENT):
        return Transient(f"{what}: {message}")
    if any(m in low for m in _REFUSED):
        return Refused(f"{what}: {message}")
    return Transient(f"{what}: {message or 'failed with no message'}")  # an unknown failure is retried, not dropped


class SlurmAdapter:
    """Slurm through its command-line tools. `slurm_conf` (or SLURM_CONF in the environment) names the cluster;
    each tool call is bounded by `timeout_s` and ended with its process group when it runs out."""
    name = "slurm"

    def __init__(self, *, timeout_s: float = 10.0, scontrol: str = "scontrol", sinfo: str = "sinfo",
                 squeue: str = "squeue", scancel: str = "scancel", slurm_conf: str | None = None,
                 claim_ttl_s: float | None = None):
        if not (math.isfinite(timeout_s) and 0 < timeout_s <= 3600):
            raise ValueError(f"timeout_s: {timeout_s!r} is not in (0, 3600]")
        self.timeout_s = float(timeout_s)
        self.tools = {"scontrol": scontrol, "sinfo": sinfo, "squeue": squeue, "scancel": scancel}
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = str(slurm_conf)
        # A claim outlives every step of a take (five tool calls) with room to spare; an agent that died holding
        # one blocks that spare only this long. Reservations are kept to the minute.
        ttl = claim_ttl_s if claim_ttl_s is not None else max(120.0, 8 * self.timeout_s)
        self.claim_ttl_s = float(math.ceil(ttl / 60.0) * 60)
        try:
            self.user = pwd.getpwuid(os.getuid()).pw_name  # the claim reservation's only user
        except KeyError:
            self.user = str(os.getuid())

    # -- reading -----------------------------------------------------------------------------------------------
    def nodes(self) -> Sequence[NodeView]:
        return [n.view for n in self._fleet()]

    def state_and_reason(self, node: str) -> tuple[str, str]:
        """(sinfo's long state, lower-case; the reason, "" when none) of this one node, read cheaply: every node of a
        cluster may ask this each HealthCheckInterval, so it is one single-node request (`sinfo -n` with one name),
        not the whole node list the other calls read (`sinfo --json` ignores --nodes on 22.05). Refused when
        slurmctld does not know the node."""
        out = self._run("sinfo", ["-h", "-N", "-n", node, "-o", "%T %E"], "this node's state")
        line = out[:8192].partition("\n")[0].strip()
        if not line:
            raise Refused(f"{node}: slurmctld does not know this node (give --node, or check SLURMD_NODENAME)")
        state, _, reason = line.partition(" ")
        reason = reason.strip()
        return state.lower(), "" if reason == "none" else reason

    def node(self, node: str) -> NodeView:
        n = self._get(node)
        if n.view.jobs is None and n.responding:
            out = self._run("squeue", ["--noheader", f"--nodelist={node}", "--format=%i",
                                       "--states=RUNNING,COMPLETING,SUSPENDED,CONFIGURING,STOPPED"])
            jobs = sum(1 for line in out.splitlines()[:1_000_000] if line.strip())
            return dataclasses.replace(n.view, jobs=jobs)
        return n.view

    def spares(self, domain: str) -> list[str]:
        _check_domain(domain)
        # A spare recorded for a failed node is promised to that node's retried take, so it is not offered.
        return [n.view.name for n in self._fleet() if self._is_spare(n, domain) and _record_of(n.comment)[0] is None]

    # -- acting ------------------------------------------------------------------------------------------------
    def cordon(self, node: str, reason: str) -> None:
        self._drain(node, reason_text(reason), "cordon")

    def drain(self, node: str, reason: str) -> None:
        # Slurm's DRAIN already lets running jobs finish and starts no new ones: cordon and drain are one update.
        self._drain(node, reason_text(reason), "drain")

    def quarantine(self, node: str, reason: str) -> None:
        self._drain(node, reason_text(reason, quarantine=True), "quarantine")

    def resume(self, node: str) -> None:
        fleet = self._fleet()
        n = self._find(fleet, _check_node(node))
        if not n.held:  # in service (Slurm marks a node NOT_RESPONDING after a RESUME until it answers a ping)
            self._forget_swaps(fleet, node)
            return
        if not n.view.ours:
            raise Refused(f"{node}: {self._held(n)}; only a drain of gpuwarden's is resumed")
        self._resume(n)
        self._forget_swaps(fleet, node)

    def publish_domain(self, node: str, domain: str) -> None:
        feature = DOMAIN_FEATURE_PREFIX + _check_domain(domain)
        n = self._get(node)
        available = tuple(f for f in n.available if not f.startswith(DOMAIN_FEATURE_PREFIX)) + (feature,)
        active = tuple(f for f in n.active if not f.startswith(DOMAIN_FEATURE_PREFIX)) + (feature,)
        # An Extra too long to read is an operator's, and is not written over (the feature alone is published).
        stored = n.extra is None or extra_domain(n.extra)[0] == domain
        if sorted(available) == sorted(n.available) and sorted(active) == sorted(n.active) and stored:
            return
        # Both lists in one update: 22.05 refuses an AvailableFeatures that no longer holds an active feature. Extra
        # in the same update: the domain survives a slurmctld restart there.
        extra = [] if stored else [f"Extra={extra_with_domain(n.extra or '', domain)}"]
        self._scontrol("publish domain", ["update", f"NodeName={node}", f"AvailableFeatures={','.join(available)}",
                                          f"ActiveFeatures={','.join(active)}", *extra])
        log.info("published NVLink domain", node=node, domain=domain)

    def return_to_pool(self, node: str, domain: str) -> None:
        _check_domain(domain)
        n = self._get(node)
        if n.view.reason and not n.view.ours and n.view.reason != SLURM_NOT_RESPONDING:
            raise Refused(f"{node}: {self._held(n)}; not taken into the spare pool over it")
        self.publish_domain(node, domain)
        fleet = self._fleet()
        self._forget_swaps(fleet, node)
        n = self._find(fleet, node)
        record, rest = _record_of(n.comment)
        if record is not None:  # its own record of standing in for another node: obsolete once back in the pool
            self._set_comment(node, rest)
        if not (n.drain and n.view.reason == SPARE_REASON):
            self._scontrol("return to pool", ["update", f"NodeName={node}", "State=DRAIN", f"Reason={SPARE_REASON}"])
            log.info("node returned to the spare pool", node=node, domain=domain)

    def take_spare(self, domain: str, for_node: str) -> str | None:
        _check_domain(domain)
        _check_node(for_node)
        fleet = self._fleet()
        claimed = self._own_claims(for_node)
        held = self._find(fleet, for_node).held
        # An earlier take for this node that did not finish is carried on: the spare recorded for it (a record for a
        # node back in service is from an earlier swap), or the spare its claim still holds.
        for n in fleet:
            recorded = held and _record_of(n.comment)[0] == for_node
            if not (recorded or n.view.name in claimed):
                continue
            if recorded and not self._is_spare(n, None):  # taken already: a retried call
                self._release(n.view.name, for_node)
                return n.view.name
            try:
                taken = self._take(n, for_node)
            except _ClaimTaken:
                if recorded:  # promised to this node, claimed by another: wait until that claim is released or ends
                    raise Busy(f"{n.view.name}: claimed by another agent; retry when the claim ends") from None
                continue
            if taken is not None:
                return taken
        for n in fleet:
            if n.view.name not in claimed and self._is_spare(n, domain) and _record_of(n.comment)[0] is None:
                try:
                    taken = self._take(n, for_node)
                except _ClaimTaken:
                    log.info("spare claimed by another agent", spare=n.view.name, domain=domain)
                    continue
                if taken is not None:
                    return taken
        return None

    # -- jobs (agent/jobs/respond.py) ------------------------------------------------------------------------------
    def job(self, job: Any) -> JobView | None:
        ident = _check_job(job)
        try:
            out = self._run("squeue", ["--json", f"--jobs={ident}"])
        except Refused as exc:
            if "invalid job id" in str(exc).lower():
                return None  # ended and purged (MinJobAge): not known any more
            raise
        return parse_squeue_job(out, ident)

    def mark_job(self, job: Any, reason: str) -> None:
        # AdminComment, not Comment: the job's owner reads it (`scontrol show job`, `sacct -o AdminComment`) and
        # cannot change it, and the user's own Comment (often a tracking id) is left alone.
        text = _clean(reason)[:4 * MAX_REASON]
        self._scontrol("mark job", ["update", f"JobId={_check_job(job)}", f"AdminComment={text}"])
        log.info("job marked", job=job.id, reason=text)

    def signal_job(self, job: Any, signal: str) -> None:
        ident = _check_job(job)
        name = str(signal).upper().removeprefix("SIG")
        if not (name.isalnum() and len(name) <= 8):
            raise Refused(f"{signal!r}: not a signal name")
        # --full: every process of the job, the batch script's shell included (without it only the steps').
        self._run("scancel", [f"--signal={name}", "--full", ident], "signal job")
        log.info("job signalled", job=ident, signal=name)

    def requeue_job(self, job: Any) -> bool:
        ident = _check_job(job)
        try:
            self._scontrol("requeue job", ["requeue", ident])
        except (Refused, Transient) as exc:
            if "is pending execution" not in str(exc).lower():
                raise
            log.info("job pending already (requeued by another)", job=ident)
            return False  # "Job is pending execution": another agent (or the job itself) requeued it first
        log.info("job requeued", job=ident)
        return True

    def cancel_job(self, job: Any) -> None:
        ident = _check_job(job)
        try:
            self._run("scancel", [ident], "cancel job")
        except (Refused, Transient) as exc:
            if "already completing or completed" not in str(exc).lower():
                raise
        log.info("job cancelled", job=ident)

    # -- the parts ---------------------------------------------------------------------------------------------
    def _take(self, n: _Node, for_node: str) -> str | None:
        """Claim `n`, check it is still a spare, record whom it stands in for, resume it, release the claim. None
        when it stopped being a spare before the claim; _ClaimTaken when another node's claim holds it."""
        spare = n.view.name
        start = time.monotonic()
        self._claim(spare, for_node)
        try:
            now = self._get(spare)  # read after the claim: what was seen before it may be stale
            record = _record_of(now.comment)[0]
            if not self._is_spare(now, None) or record not in (None, for_node):
                log.info("spare gone before it was claimed", spare=spare, reason=now.view.reason)
                return None
            if record is None:
                self._set_comment(spare, f"{RECORD_PREFIX}{for_node}", keep=now.comment)
            if time.monotonic() - start + self.timeout_s >= self.claim_ttl_s:
                raise Transient(f"{spare}: the claim ran out before the spare could be resumed")
            self._resume(now)
            log.info("spare taken into service", spare=spare, for_node=for_node)
            return spare
        finally:
            self._release(spare, for_node)

    def _claim(self, spare: str, for_node: str) -> None:
        """Creates the claim on `spare` for `for_node`, or renews this node's own claim that an earlier call left
        (the agent died, or slurmctld went away, before the release). _ClaimTaken when another node's claim holds
        the spare."""
        claim = claim_name(spare, for_node)
        try:
            self._scontrol("claim spare", ["create", "reservation", f"ReservationName={claim}", f"Nodes={spare}",
                                           f"Users={self.user}", "StartTime=now",
                                           f"Duration={int(self.claim_ttl_s // 60)}", "Flags=IGNORE_JOBS"])
            return
        except Refused as exc:
            if not any(m in str(exc).lower() for m in _CLAIM_TAKEN):
                raise
            taken = str(exc)
        # 22.05 answers a second reservation on the node with "overlaps" before it looks at the name, so whose claim
        # is in the way is asked by renewing this node's own: slurmctld refuses to renew a name it does not have, or
        # one that would overlap another node's claim (an update is checked like a creation).
        try:
            self._scontrol("renew claim", ["update", f"ReservationName={claim}",
                                           f"EndTime=now+{int(self.claim_ttl_s)}"])
        except Refused:
            raise _ClaimTaken(taken) from None
        log.info("carrying on with this node's own claim left by an earlier take", spare=spare, for_node=for_node)

    def _own_claims(self, for_node: str) -> list[str]:
        """The spares whose claim for `for_node` an earlier take left behind (`scontrol show reservation -o`, one
        reservation a line)."""
        out = self._run("scontrol", ["show", "reservation", "-o"], "show reservations")
        found = []
        for line in out.splitlines()[:MAX_RESERVATIONS]:
            name = nodes = None
            for token in line[:8192].split():
                key, _, value = token.partition("=")
                if key == "ReservationName":
                    name = value
                elif key == "Nodes":
                    nodes = value
            if name and nodes and valid_name(nodes, MAX_NAME) and name == claim_name(nodes, for_node):
                found.append(nodes)
        return found

    def _release(self, spare: str, for_node: str) -> None:
        try:
            self._scontrol("release claim", ["delete", f"ReservationName={claim_name(spare, for_node)}"])
        except Refused as exc:  # not there (released before, or its time ran out)
            if "not found" not in str(exc).lower() and "invalid" not in str(exc).lower():
                raise

    def _drain(self, node: str, text: str, action: str) -> None:
        n = self._get(node)
        if n.drain and (n.view.reason == text or (n.view.quarantined and action != "quarantine")):
            return  # done, or held for recovery already: a late cordon does not undo a quarantine
        if n.view.reason and not n.view.ours and n.view.reason != SLURM_NOT_RESPONDING:
            if action == "quarantine":
                raise Refused(f"{node}: {self._held(n)}; not taken over for recovery")
            log.info("node already held out by someone else; left as it is", node=node, reason=n.view.reason)
            return
        self._scontrol(action, ["update", f"NodeName={node}", "State=DRAIN", f"Reason={text}"])
        log.info("node drained", node=node, action=action, reason=text)

    def _resume(self, n: _Node) -> None:
        try:
            self._scontrol("resume", ["update", f"NodeName={n.view.name}", "State=RESUME"])
        except Refused as exc:
            # 22.05 refuses RESUME of a node that is not drained or down: fine when it is in service by now.
            if "invalid node state" not in str(exc).lower() or self._get(n.view.name).held:
                raise

    def _forget_swaps(self, fleet: list[_Node], node: str) -> None:
        """`node` is back (in service or in the pool): the records of spares taken for it are done with."""
        for n in fleet:
            record, rest = _record_of(n.comment)
            if record == node:
                self._set_comment(n.view.name, rest)

    def _set_comment(self, node: str, text: str, keep: str = "") -> None:
        """Sets the Comment; an operator's comment (`keep`, not ours) stays after ours."""
        _, rest = _record_of(keep)
        value = f"{text}; {rest}" if text and rest else text
        self._scontrol("comment", ["update", f"NodeName={node}", f"Comment={value}"])

    @staticmethod
    def _is_spare(n: _Node, domain: str | None) -> bool:
        return (n.view.spare and n.drain and n.responding and n.view.service is Service.DRAINED
                and (domain is None or n.view.domain == domain))

    @staticmethod
    def _held(n: _Node) -> str:
        return f"held out by someone else (Reason={n.view.reason!r})"

    def _fleet(self) -> list[_Node]:
        return parse_sinfo_json(self._run("sinfo", ["--json"]))

    def _find(self, fleet: list[_Node], node: str) -> _Node:
        for n in fleet:
            if n.view.name == node:
                return n
        raise Refused(f"{node}: slurmctld does not know this node")

    def _get(self, node: str) -> _Node:
        return self._find(self._fleet(), _check_node(node))

    def _scontrol(self, what: str, args: list[str]) -> str:
        return self._run("scontrol", args, what)

    def read(self, tool: str, args: list[str]) -> str:
        """stdout of a read-only Slurm tool (`sinfo`, `squeue`, `scontrol show ...`), run as every call of this
        adapter runs its tools (no shell, own process group, timeout_s, errors classified): for readers of the
        cluster's view outside the adapter (gpuwarden plan defrag)."""
        return self._run(tool, args)

    def _run(self, tool: str, args: list[str], what: str | None = None) -> str:
        """Runs one Slurm tool with no shell, in a process group of its own, for at most timeout_s; returns its
        stdout. A tool that runs out is killed with its group and is Transient; a failure is classified by its
        message."""
        what = f"{tool} {what or args[0]}"
        exe = shutil.which(self.tools[tool], path=self.env.get("PATH"))
        if exe is None:
            raise Transient(f"{self.tools[tool]}: not installed (not on PATH); install slurm-client")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen([exe, *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=self.env,
                                        start_new_session=True)
            except OSError as exc:
                raise Transient(f"{what}: cannot run: {exc.strerror or exc}") from None
            try:
                proc.wait(timeout=self.timeout_s)
            except BaseException as exc:
                # Killed as a group before it is reaped, so the group id cannot name another process yet.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                if isinstance(exc, subprocess.TimeoutExpired):
                    raise Transient(f"{what}: no answer within {self.timeout_s:g}s (killed); slurmctld busy or "
                                    "hung") from None
                raise
            out.seek(0)
            stdout = out.read(MAX_OUTPUT + 1)
            err.seek(0)
            stderr = err.read(MAX_STDERR).decode(errors="replace")
        if len(stdout) > MAX_OUTPUT:
            raise Transient(f"{what}: printed more than {MAX_OUTPUT >> 20} MiB; not read")
        text = stdout.decode(errors="replace")
        if proc.returncode != 0:
            message = " ".join((stderr.strip() or text.strip()).split())[:500]
            raise _classify(what, message)
        return text
