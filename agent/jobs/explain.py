"""Which node, GPU, IB port or rank failed a distributed job: the job's logs (agent/jobs/joblog.py) and gpuwarden's
own findings on the job's nodes (agent/jobs/node_evidence.py) put together. Pure: events and evidence in, an
`Explanation` out.

The steps, each a piece of evidence with its file and line:
- (a) gpuwarden's findings on the job's nodes in the job's window, mapped to ranks through the log's tables
  (NCCL's `comm .. rank R nranks N cudaDev D busId B` lines give rank -> host, GPU and PCI bus id);
- (b) the rank that stalled: the lowest last-completed work of one process group (ProcessGroupNCCL's progress
  lines), the rank a desync report names, or the one rank missing from a collective every other rank reported;
- (c) NCCL's peer errors: the host or address other ranks' errors point to (an IB completion error, a refused
  connection; a peer that closed its sockets first);
- (d) the first failure in time: torchrun's root cause where its time is earlier than the others', srun's first
  task that exited with an error, a node Slurm saw fail.
A hardware finding that matches the rank (b), peer (c) or first failure (d) outranks the rest; then (b) with (c)
agreeing. Where the evidence points two ways the explanation says so and names no culprit; nothing is named that
no evidence points to. A rank is its global rank where the log shows it (`[rank3]:`, a world-sized communicator),
else the rank its process group printed (said so).

Here: the verdict from the steps' answers. The steps are agent/jobs/explain_steps.py's; where each rank ran (the
logs' tables) agent/jobs/explain_places.py's.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs.explain_places import (
    Step,
    _map_step,
    _Pointer,
    _step,
    _Tables,
    culprit,
    pci_text,
    short,
)
from gpuwarden.agent.jobs.explain_steps import (
    _agrees,
    _first_failure,
    _log_hardware,
    _node_hardware,
    _peers,
    _same_place,
    _stalled,
    _symptom_steps,
    _symptoms,
)
from gpuwarden.agent.jobs.joblog import JobLog, LogEvent
from gpuwarden.agent.jobs.node_evidence import NodeEvidence

NO_FAILURE, CULPRIT, UNDECIDED = "no-failure", "culprit", "undecided"
EXIT = {NO_FAILURE: 0, CULPRIT: 1, UNDECIDED: 2}


@dataclass(frozen=True)
class Explanation:
    verdict: str  # NO_FAILURE | CULPRIT | UNDECIDED
    culprit: Mapping[str, Any]  # kind, host, rank, gpu, port (+ local_rank, pci, link where known)
    cause: str | None  # hardware | fabric | software | unknown; None when nothing failed
    summary: str
    action: str | None
    evidence: tuple[Step, ...]
    conflicts: tuple[str, ...] = ()
    unreachable: tuple[Mapping[str, Any], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "culprit": dict(self.culprit), "cause": self.cause,
                "summary": self.summary, "action": self.action,
                "evidence": [s.to_dict() for s in self.evidence], "conflicts": list(self.conflicts),
                "unreachable": [dict(u) for u in self.unreachable], "notes": list(self.notes)}


def explain(logs: Sequence[JobLog], nodes: Sequence[NodeEvidence] = (), job_nodes: Sequence[str] = ()
            ) -> Explanation:
    events = [e for log in logs for e in log.events]
    notes = [n for log in logs for n in log.notes] + [log.error for log in logs if log.error]
    unreachable = tuple({"host": n.host, "source": n.source, "error": n.error} for n in nodes if not n.reachable)
    # A check that could not look on a node is no sign of health there: said beside the answer.
    notes += [f"gpuwarden on {n.host} could not look at {u.get('check')}: {u.get('error')}"
              for n in nodes if n.reachable for u in getattr(n, "unknown", ())]
    t = _Tables(events)
    hardware = _node_hardware(nodes, t)
    log_hw = _log_hardware(events, t)
    stall = _stalled(events, t)
    peers = _peers(events, t)
    first = _first_failure(events, t)
    mapping = tuple(_map_step(p) for p in sorted(t.places.values(), key=lambda p: p.rank)[:0])
    ctx = _Ctx(t, unreachable, tuple(notes), events, frozenset(short(n.host) for n in nodes if n.reachable))

    pointers = [p for p in (stall, peers, first) if p is not None]
    if hardware:
        matched = [h for h in hardware if any(_agrees(h, p, t) for p in pointers)]
        if matched:
            best = matched[0]
            return ctx.named(best, [p for p in pointers if _agrees(best, p, t)])
        hosts = {short(h.host) for h in hardware}
        if not pointers and len(hosts) == 1:
            return ctx.named(hardware[0], [])
        if not pointers:
            return ctx.undecided(f"gpuwarden found faults on {len(hosts)} of the job's nodes in its window and the "
                                 "logs point at none of them", [s for h in hardware for s in h.steps],
                                 [h.what for h in hardware], "hardware")
        return ctx.undecided("the node evidence and the logs point at different places",
                             [s for h in hardware + pointers for s in h.steps],
                             [h.what for h in hardware] + [p.what for p in pointers], None)
    if log_hw is not None:
        against = [p for p in (stall,) if p is not None and not _same_place(log_hw, p, t)]
        if against:
            return ctx.undecided("the logs show a GPU failure and a stalled rank in different places",
                                 list(log_hw.steps) + [s for p in against for s in p.steps],
                                 [log_hw.what] + [p.what for p in against], "hardware")
        return ctx.named(log_hw, [p for p in pointers if _same_place(log_hw, p, t)])
    if stall is not None:
        if peers is not None and not _same_place(stall, peers, t):
            return ctx.undecided("the stalled rank and the peer the others' errors name are on different hosts",
                                 list(stall.steps + peers.steps), [stall.what, peers.what], None)
        agreeing = [p for p in (peers, first) if p is not None and _same_place(stall, p, t)]
        return ctx.named(stall, agreeing)
    if peers is not None:
        if peers.cause is None:  # an error that names the link but says nothing of which end
            return ctx.undecided(peers.what, list(peers.steps), [], "fabric")
        return ctx.named(peers, [p for p in (first,) if p is not None and _same_place(peers, p, t)])
    if first is not None:
        return ctx.named(first, [])
    return ctx.unnamed(mapping)


class _Ctx:
    def __init__(self, t: _Tables, unreachable: tuple, notes: tuple[str, ...], events: Sequence[LogEvent],
                 read: frozenset = frozenset()):
        self.t, self.unreachable, self.notes, self.events = t, unreachable, notes, events
        self.read = read  # the hosts whose node evidence was read: only of those can gpuwarden say it saw no fault

    def _unreach_note(self) -> str:
        if not self.unreachable:
            return ""
        names = ", ".join(f"{u['host']} ({u['error']})" for u in self.unreachable)
        return f" Could not reach gpuwarden on: {names}."

    def named(self, p: _Pointer, agreeing: Sequence[_Pointer]) -> Explanation:
        steps = list(p.steps) + [s for a in agreeing for s in a.steps if s not in p.steps]
        c = dict(p.culprit) if p.culprit is not None else self._rank_culprit(p)
        if c["rank"] is not None and c["rank"] in self.t.places:
            place = self.t.places[c["rank"]]
            steps.append(_map_step(place))
        cause = p.cause or next((a.cause for a in agreeing if a.cause), None) or "unknown"
        action = self._action(p, c)
        where = _where(c)
        also = "; ".join(a.what for a in agreeing)
        summary = f"{where}: {p.what}" + (f" (agrees: {also})" if also else "") + "." + self._unreach_note()
        return Explanation(CULPRIT, c, cause, summary, action, tuple(_dedupe(steps)), (), self.unreachable,
                           self.notes)

    def _rank_culprit(self, p: _Pointer) -> dict[str, Any]:
        place = self.t.places.get(p.rank) if p.rank is not None else None
        host = p.host or (place.host if place else None)
        extra = dict(p.extra or {})
        kind = extra.pop("kind", "rank" if p.rank is not None else "node")
        gpu = extra.pop("gpu", None)
        if gpu is None and place is not None and place.bus is not None and kind in ("gpu", "rank"):
            gpu = pci_text(place.bus)
        return culprit(kind, host, p.rank, gpu, extra.pop("port", None), **extra)

    def _action(self, p: _Pointer, c: Mapping[str, Any]) -> str:
        if p.action:
            return p.action
        rank, host = c.get("rank"), c.get("host")
        tb = next((e for e in self.events if e.kind == "traceback" and rank is not None
                   and self.t.rank_of(e) == rank), None)
        who = f"rank {rank}" if rank is not None else f"the rank(s) on {host}"
        if tb is not None:
            return f"read {who}'s own traceback at {tb.where()}"
        on = f" on {host}" if host and rank is not None else ""
        if not host:
            seen = ""
        elif any(short(u["host"]) == short(host) for u in self.unreachable):
            seen = " gpuwarden on that node could not be reached: run `gpuwarden preflight` there"
        elif short(host) in self.read:
            seen = " gpuwarden saw no fault there in the job's window"
        else:  # not asked: silence is not health
            seen = (" gpuwarden's findings on that node were not read: give --nodes, --evidence or --prometheus, or "
                    "run `gpuwarden preflight` there")
        return f"read {who}'s own log{on} (stderr, the lines before its last collective);{seen}".rstrip(";")

    def undecided(self, why: str, steps: Iterable[Step], candidates: Sequence[str], cause: str | None
                  ) -> Explanation:
        conflicts = tuple(candidates)
        summary = f"No culprit: {why}." + (" Candidates: " + "; ".join(candidates) + "." if candidates else "")
        return Explanation(UNDECIDED, culprit(), cause or "unknown", summary + self._unreach_note(),
                           "compare the candidates' own logs and nodes" if candidates else None,
                           tuple(_dedupe(steps)), conflicts, self.unreachable, self.notes)

    def unnamed(self, mapping: Sequence[Step]) -> Explanation:
        ev = self.events
        steps: list[Step] = []
        cancel = [e for e in ev if e.kind == "slurm_cancel"]
        if cancel:
            why = cancel[0].fields.get("why")
            if why in ("TIME LIMIT", "PREEMPTION", None):
                what = {"TIME LIMIT": "the job reached its time limit", "PREEMPTION": "the job was preempted",
                        None: "the job was cancelled (by its owner or an administrator)"}[why]
                return Explanation(NO_FAILURE, culprit(), "software" if why == "TIME LIMIT" else None,
                                   f"No fault: {what} ({cancel[0].fields['what']} {cancel[0].fields['id']} at "
                                   f"{cancel[0].fields['at']}); {cancel[0].fields['batch_host']} is only the host "
                                   "Slurm reports it on." + self._unreach_note(),
                                   "no node is at fault: raise the time limit or resume from the last checkpoint"
                                   if why == "TIME LIMIT" else None,
                                   (_step("d", cancel[0]),), (), self.unreachable, self.notes)
            steps.append(_step("d", cancel[0]))
        symptoms = _symptoms(ev, self.t)
        if symptoms or steps:
            whats = [w for w, _ in symptoms]
            cause = "software" if any(c == "software" for _, c in symptoms) else None
            return self.undecided("the logs show the failure but not where it started: " + "; ".join(whats),
                                  steps + [s for _, s in _symptom_steps(ev)], [], cause)
        if any(log_error for log_error in self.notes) and not ev:
            return Explanation(UNDECIDED, culprit(), "unknown", "No culprit: the logs could not be read. "
                               + " ".join(self.notes), None, (), (), self.unreachable, self.notes)
        return Explanation(NO_FAILURE, culprit(), None, "The logs show no failure." + self._unreach_note(), None,
                           tuple(mapping), (), self.unreachable, self.notes)


def _dedupe(steps: Iterable[Step]) -> list[Step]:
    seen, out = set(), []
    for s in steps:
        key = (s.source, s.line, s.text)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _where(c: Mapping[str, Any]) -> str:
    kind = c["kind"]
    host = c.get("host")
    on = f" on {host}" if host else ""
    if kind == "gpu":
        gpu = c.get("gpu")
        who = (f" of rank {c['rank']}" if c.get("rank") is not None
               else f" of local rank {c['local_rank']}" if c.get("local_rank") is not None else "")
        who = who or ("" if host else " of a rank the log does not name")
        return f"GPU{' ' + gpu if gpu else ''}{who}{on}"
    if kind == "ib_port":
        if c.get("port"):
            return f"InfiniBand port {c['port']}{on}"
        if c.get("link"):
            return f"InfiniBand link {c['link'][0]} <-> {c['link'][1]}"
        return f"InfiniBand{on}"
    if kind == "nvlink":
        return f"NVLink{' of GPU ' + c['gpu'] if c.get('gpu') else ''}{on}"
    if kind == "rank":
        return f"rank {c['rank']}{on}" if c.get("rank") is not None else f"the rank(s){on}"
    return f"node {host}" if host else "a node"
