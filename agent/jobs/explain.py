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
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs.joblog import JobLog, LogEvent
from gpuwarden.agent.jobs.joblog_lines import bus_id
from gpuwarden.agent.jobs.node_evidence import NodeEvidence

NO_FAILURE, CULPRIT, UNDECIDED = "no-failure", "culprit", "undecided"
EXIT = {NO_FAILURE: 0, CULPRIT: 1, UNDECIDED: 2}

# Node findings that can end a job's collectives or say its GPU/port failed: FAIL, or a recommended action of at
# least restarting the application.
_SERIOUS_ACTIONS = ("RESTART_APP", "DRAIN", "RESET_GPU", "REBOOT", "SERVICE")
_FLUSH = 5  # IBV_WC_WR_FLUSH_ERR: a queue pair flushed after an earlier error (FACTS.md), a follow-up
_RETRY_EXCEEDED = 12  # IBV_WC_RETRY_EXC_ERR: the NICs could not talk to each other


@dataclass(frozen=True)
class Step:
    step: str  # "a" node evidence, "b" stalled rank, "c" peer errors, "d" first failure, "map" a table line
    source: str
    line: int | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "source": self.source, "line": self.line, "text": self.text}


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


def culprit(kind: str = "none", host: str | None = None, rank: int | None = None, gpu: Any = None,
            port: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "host": host, "rank": rank, "gpu": gpu, "port": port, **extra}


def short(host: str | None) -> str | None:
    """A host as a scheduler names it: the first label, lower case (NCCL prints gethostname(), Slurm the node)."""
    if not host:
        return None
    return host.split(".")[0].lower() if not _is_ip(host) else host


def _is_ip(text: str) -> bool:
    parts = text.split(".")
    return (len(parts) == 4 and all(p.isdigit() for p in parts)) or text.count(":") >= 2


@dataclass(frozen=True)
class RankPlace:
    rank: int
    host: str | None
    cuda_dev: int | None
    bus: int | None
    event: LogEvent

    def gpu_text(self) -> str:
        parts = []
        if self.cuda_dev is not None:
            parts.append(f"cudaDev {self.cuda_dev}")
        if self.bus is not None:
            parts.append(f"busId {pci_text(self.bus)}")
        return ", ".join(parts)


def pci_text(bus: int) -> str:
    return f"{bus >> 20:04x}:{(bus >> 12) & 0xff:02x}:{(bus >> 4) & 0xff:02x}.{bus & 0xf:x}"


class _Tables:
    """What the logs say about where each rank ran: rank -> host/GPU, (host, pid) -> rank, IP -> host."""

    def __init__(self, events: Sequence[LogEvent]):
        self.world = max((e.fields["nranks"] for e in events if e.kind == "comm"), default=None)
        self.places: dict[int, RankPlace] = {}
        self.pid_rank: dict[tuple[str | None, int], int] = {}
        self.ip_host: dict[str, str] = {}
        self.hosts: set[str] = set()
        for e in events:
            if e.host and not e.host.startswith("<"):
                self.hosts.add(short(e.host) or "")
            if e.kind == "comm":
                rank = e.rank if e.rank is not None and e.fields.get("_rank_from") != "tag" else None
                if rank is None and e.fields["nranks"] == self.world:
                    rank = e.fields["comm_rank"]
                if rank is None and e.rank is not None:
                    rank = e.rank
                if rank is not None:
                    self._place(RankPlace(rank, e.host, e.fields["cuda_dev"], e.fields["bus"], e))
                    if e.pid is not None:
                        self.pid_rank[(short(e.host), e.pid)] = rank
            elif e.kind == "tests_rank":
                self._place(RankPlace(e.fields["rank"], e.fields["host"], e.fields["dev"], e.fields["bus"], e))
            elif e.kind in ("bootstrap", "ib_devices") and e.host:
                for ip in e.fields.get("ips") or [e.fields.get("oob_ip")]:
                    if ip:
                        self.ip_host[ip] = e.host
            elif e.kind == "torchrun_failure" and e.rank is not None and e.host:
                self.places.setdefault(e.rank, RankPlace(e.rank, e.host, None, None, e))
        for e in events:  # a line whose rank its launcher prefix gives, and NCCL's host prefix
            if e.rank is not None and e.host and e.rank not in self.places and e.kind != "torchrun_failure":
                self.places[e.rank] = RankPlace(e.rank, e.host, e.dev, None, e)

    def _place(self, p: RankPlace) -> None:
        old = self.places.get(p.rank)
        if old is None or (old.bus is None and p.bus is not None):
            self.places[p.rank] = p

    def rank_of(self, e: LogEvent) -> int | None:
        if e.rank is not None:
            return e.rank
        if e.pid is not None and (short(e.host), e.pid) in self.pid_rank:
            return self.pid_rank[(short(e.host), e.pid)]
        pg, name, pg_rank = e.fields.get("pg"), e.fields.get("pg_name"), e.fields.get("pg_rank")
        if pg_rank is not None and (pg == 0 or name == "default_pg"):
            return pg_rank
        return None

    def host_of(self, e: LogEvent) -> str | None:
        if e.host and not e.host.startswith("<"):
            return e.host
        r = self.rank_of(e)
        return self.places[r].host if r is not None and r in self.places else None

    def peer_host(self, peer: str) -> str:
        return self.ip_host.get(peer, peer)


@dataclass(frozen=True)
class _Pointer:
    """One line of reasoning's answer: a rank and/or host, with its evidence. `extra`: culprit fields it knows
    itself (kind, link, local_rank); `action` what to do where it knows. A node finding (step "a") also carries the
    culprit it names whole (`culprit`), the ranks it maps to, its GPU's bus id and how severe it is."""

    step: str
    rank: int | None
    host: str | None
    steps: tuple[Step, ...]
    what: str
    cause: str | None = None
    extra: Mapping[str, Any] | None = None
    action: str | None = None
    culprit: Mapping[str, Any] | None = None
    ranks: tuple[int, ...] = ()
    bus: int | None = None
    severity: int = 0


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


def _node_hardware(nodes: Sequence[NodeEvidence], t: _Tables) -> list[_Pointer]:
    out: list[_Pointer] = []
    for n in nodes:
        if not n.reachable:
            continue
        for f in n.findings:
            status, action = str(f.get("status", "")), str(f.get("action", "NONE"))
            if status != "FAIL" and action not in _SERIOUS_ACTIONS:
                continue
            ent = f.get("entity") or {}
            kind = str(ent.get("kind") or "node")
            pci = ent.get("pci")
            bus = bus_id(pci) if isinstance(pci, str) else None
            ranks = tuple(sorted(p.rank for p in t.places.values()
                                 if short(p.host) == short(n.host) and (bus is None or p.bus == bus)))
            label = {"gpu": "gpu", "pcie": "gpu", "ib_port": "ib_port", "nvlink": "nvlink"}.get(kind, "node")
            gpu = pci if label in ("gpu", "nvlink") else None
            port = ent.get("id") if label == "ib_port" else None
            c = culprit(label, n.host, ranks[0] if len(ranks) == 1 else None, gpu, port,
                        gpu_index=ent.get("index"), finding=f"{f.get('check')}/{f.get('code')}",
                        link=ent.get("link"))
            check, code = f.get("check"), f.get("code")
            what = (f"gpuwarden on {n.host}: {check} {code} {status} on {ent.get('id') or kind}"
                    f"{' (' + pci + ')' if pci else ''}: {f.get('message', '')}")
            when = f.get("last_at") or f.get("first_at")
            step = Step("a", n.source, None, what + (f" [at {when}]" if when else ""))
            cause = "fabric" if label == "ib_port" else "hardware"
            ladder = _SERIOUS_ACTIONS.index(action) + 1 if action in _SERIOUS_ACTIONS else 0
            act = (f"gpuwarden on {n.host} recommends {action} for {ent.get('id') or kind}"
                   f"{' (' + pci + ')' if pci else ''}; keep the node out of the job's next run "
                   f"(Slurm: --exclude={short(n.host)}) until it passes `gpuwarden preflight`")
            out.append(_Pointer("a", c["rank"], n.host, (step,), what, cause, None, act, c, ranks, bus, ladder))
    out.sort(key=lambda h: (-h.severity, h.host or ""))
    return out


def _agrees(h: _Pointer, p: _Pointer, t: _Tables) -> bool:
    if p.rank is not None and h.ranks:
        return p.rank in h.ranks
    if p.rank is not None and p.rank in t.places and h.bus is not None:
        place = t.places[p.rank]
        return short(place.host) == short(h.host) and place.bus == h.bus
    host = p.host or (t.places[p.rank].host if p.rank is not None and p.rank in t.places else None)
    return host is not None and short(host) == short(h.host)


def _same_place(a: _Pointer, b: _Pointer, t: _Tables) -> bool:
    if a.rank is not None and b.rank is not None:
        return a.rank == b.rank
    ha, hb = _host(a, t), _host(b, t)
    return ha is not None and hb is not None and short(ha) == short(hb)


def _host(p: _Pointer, t: _Tables) -> str | None:
    if p.host:
        return p.host
    return t.places[p.rank].host if p.rank is not None and p.rank in t.places else None


def _log_hardware(events: Sequence[LogEvent], t: _Tables) -> _Pointer | None:
    hits = [e for e in events if (e.kind == "cuda_error" and e.fields.get("hardware")) or e.kind == "xid"]
    if not hits:
        return None
    e = hits[0]
    rank = t.rank_of(e)
    host = t.host_of(e)
    part = e.fields.get("part") or "gpu"
    what = (f"XID {e.fields['xid']} on {e.fields['pci']} in the job's log" if e.kind == "xid"
            else f"{e.fields['hardware']} ({e.fields['message']})")
    who = (f"rank {rank}" if rank is not None else f"local rank {e.local_rank}" if e.local_rank is not None
           else "a rank the log does not name")
    extra: dict[str, Any] = {"kind": part}
    if e.local_rank is not None:
        extra["local_rank"] = e.local_rank
    if e.kind == "xid":
        extra["gpu"] = e.fields["pci"]
    find = ("" if host else " and the log names no host: find it with `gpuwarden explain --job ID`, which asks each "
            "node, or write one log per node (sbatch --output=%x-%j-%N.out)")
    ptr = _Pointer("d", rank, host, (_step("a", e),), f"the GPU failed: {what}", "hardware", extra,
                 f"the GPU of {who}{' on ' + host if host else ''} failed{find}; keep that node out of the next run "
                 "until `gpuwarden preflight` passes there")
    return ptr


def _stalled(events: Sequence[LogEvent], t: _Tables) -> _Pointer | None:
    desync = [e for e in events if e.kind == "desync_rank"]
    if desync:
        ranks = sorted({e.fields["lagging"] for e in desync})
        if len(ranks) == 1:
            e = desync[0]
            return _Pointer("b", ranks[0], None, tuple(_step("b", d) for d in desync[:3]),
                            f"rank {ranks[0]} is the lagging rank of the desync report ({e.fields['what']})")
    groups: dict[Any, dict[int, LogEvent]] = defaultdict(dict)
    for e in events:
        if e.kind == "pg_progress":
            rank = t.rank_of(e)
            if rank is None and e.fields.get("pg") is not None:
                rank = e.fields.get("pg_rank")  # a rank of that group only
            if rank is not None:
                groups[(e.fields.get("pg"), e.fields.get("pg_name"))][rank] = e
    for key, by_rank in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len(by_rank) < 2:
            continue
        done = {r: e.fields["completed"] for r, e in by_rank.items()}
        low = min(done.values())
        if low == max(done.values()):
            continue
        lagging = sorted(r for r, d in done.items() if d == low)
        hosts = {short(t.places[r].host) for r in lagging if r in t.places}
        ahead = next(e for r, e in by_rank.items() if done[r] != low)
        steps = tuple(_step("b", by_rank[r]) for r in lagging[:3]) + (_step("b", ahead),)
        if len(lagging) == 1:
            r = lagging[0]
            return _Pointer("b", r, None, steps, f"rank {r} stalled: its last completed work is {low}, the other "
                            f"ranks of process group {key[0] if key[0] is not None else key[1]} reached "
                            f"{max(done.values())}")
        if len(hosts) == 1 and len(hosts - {None}) == 1:
            host = next(iter(hosts))
            return _Pointer("b", None, host, steps, f"ranks {', '.join(map(str, lagging))} on {host} stalled at "
                            f"work {low}")
    # The one rank missing from a collective every other rank of the world reported waiting in.
    world = t.world
    waiting = [e for e in events if e.kind in ("watchdog_timeout", "pg_progress")]
    if world and waiting:
        seen = {t.rank_of(e) for e in waiting} - {None}
        missing = set(range(world)) - seen
        if len(missing) == 1 and len(seen) == world - 1:
            r = missing.pop()
            return _Pointer("b", r, None, tuple(_step("b", e) for e in waiting[:2]),
                            f"rank {r} is the one rank of {world} that did not report waiting in the collective "
                            "every other rank timed out in")
    return None


def _peers(events: Sequence[LogEvent], t: _Tables) -> _Pointer | None:
    named: dict[str, dict[str, list[LogEvent]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.kind not in ("ib_completion", "connect_failed", "peer_gone"):
            continue
        if e.kind == "ib_completion" and e.fields["status"] == _FLUSH:
            continue
        reporter = short(t.host_of(e)) or "?"
        peer = short(t.peer_host(e.fields["peer"])) or e.fields["peer"]
        if peer == reporter:
            continue  # a socket of the reporter's own host (an intra-node proxy): says nothing of another node
        named[peer][reporter].append(e)
    if not named:
        return None

    def weight(item: tuple[str, dict[str, list[LogEvent]]]) -> tuple[int, int]:
        peer, by = item
        hard = sum(1 for evs in by.values() for e in evs if e.kind != "peer_gone")
        return (len(by), hard)

    ranked = sorted(named.items(), key=weight, reverse=True)
    peer, by = ranked[0]
    if len(ranked) > 1 and weight(ranked[1]) == weight(ranked[0]):
        return None  # two peers named as often: no single direction
    evs = [e for reporters in by.values() for e in reporters]
    kinds = {e.kind for e in evs}
    steps = tuple(_step("c", e) for e in evs[:4])
    reporters = sorted(by)
    who = ", ".join(reporters)
    if "connect_failed" in kinds:
        return _Pointer("c", None, peer, steps, f"{who} could not connect to {peer} "
                      f"({next(e for e in evs if e.kind == 'connect_failed').fields['why']})", "fabric",
                      {"kind": "node"}, f"the other nodes cannot connect to {peer}: keep it out of the job "
                      f"(Slurm: --exclude={peer}) and check its network")
    ib = [e for e in evs if e.kind == "ib_completion"]
    if ib:
        status = ib[0].fields["status"]
        if len(reporters) >= 2:
            return _Pointer("c", None, peer, steps, f"{len(reporters)} hosts ({who}) got InfiniBand completion errors "
                          f"(status {status}) from {peer}", "fabric", {"kind": "ib_port"},
                          f"check {peer}'s InfiniBand ports (`gpuwarden preflight` there: ib_port, rdma_loopback)")
        if status == _RETRY_EXCEEDED:
            e = ib[0]
            dev = f" (the NIC of cudaDev {e.dev})" if e.dev is not None else ""
            return _Pointer("c", None, None, steps, f"the InfiniBand link between {reporters[0]}{dev} and {peer} "
                          f"failed: status 12, vendor err {e.fields['vendor']} (retry count exceeded: the NICs "
                          "could not talk to each other)", "fabric",
                          {"kind": "ib_port", "link": [reporters[0], peer]},
                          f"check the InfiniBand path between {reporters[0]} and {peer}: their ports, cables and "
                          "switch (`gpuwarden preflight` on both: ib_port, rdma_loopback); NCCL's error does not say "
                          "which end failed")
        return _Pointer("c", None, None, steps, f"{reporters[0]} got an InfiniBand completion error (status "
                        f"{status}, vendor err {ib[0].fields['vendor']}) from {peer}" +
                        (": status 4 (local protection error) is usually ACS or the IOMMU breaking GPUDirect RDMA "
                         f"on {reporters[0]}" if status == 4 else ""), None)
    return _Pointer("c", None, peer, steps, f"{peer} went away first: {who} lost its connection to it "
                  f"({evs[0].fields['why']})", "software", {"kind": "rank"},
                  f"read the log of the rank(s) on {peer}: the process there ended first (a crash before these "
                  "errors)")


def _first_failure(events: Sequence[LogEvent], t: _Tables) -> _Pointer | None:
    fails = [e for e in events if e.kind == "node_failure"]
    if fails:
        e = fails[0]
        return _Pointer("d", None, e.fields["host"], (_step("d", e),), f"Slurm saw node {e.fields['host']} fail",
                      "unknown", {"kind": "node"}, f"look at {e.fields['host']}: Slurm lost it during the job")
    runs = [e for e in events if e.kind == "torchrun_failure" and e.stamp]
    if len(runs) >= 2:
        first = min(runs, key=lambda e: e.stamp[1])  # type: ignore[index]
        if sum(1 for e in runs if e.stamp == first.stamp) == 1:
            return _Pointer("d", first.rank, first.host, (_step("d", first),),
                            f"rank {first.rank} on {first.host} failed first ({first.fields.get('time')}, exitcode "
                            f"{first.fields.get('exitcode')})", "unknown")
    srun = [e for e in events if e.kind == "srun_task" and not e.fields["killed"]]
    if srun:
        e = srun[0]
        tasks = e.fields["tasks"]
        rank = int(tasks) if tasks.isdigit() else None
        return _Pointer("d", rank, e.fields["host"], (_step("d", e),),
                        f"task {tasks} on {e.fields['host']} was the first to fail ({e.fields['how']})", "unknown")
    return None


def _symptoms(events: Sequence[LogEvent], t: _Tables) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    kinds = defaultdict(list)
    for e in events:
        kinds[e.kind].append(e)
    if kinds["watchdog_timeout"] or kinds["pg_progress"]:
        ranks = sorted({r for e in kinds["watchdog_timeout"] + kinds["pg_progress"]
                        if (r := t.rank_of(e) if t.rank_of(e) is not None else e.fields.get("pg_rank")) is not None})
        seqs = {e.fields.get("seq") for e in kinds["watchdog_timeout"]} - {None}
        done = {e.fields.get("completed") for e in kinds["pg_progress"]}
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "ranks")
        if len(seqs) <= 1 and len(done) <= 1:
            out.append((f"{who} timed out waiting in the same collective; the rank they waited for is not among "
                        "the lines (every rank shown reached the same work)", None))
        else:
            out.append((f"{who} timed out waiting", None))
        if len(seqs) > 1 and all(e.fields.get("pg") is None for e in kinds["watchdog_timeout"]):
            out.append(("the timed-out works' SeqNums belong to different process groups the lines do not name, "
                        "so they cannot be compared", None))
    if kinds["heartbeat"]:
        out.append(("ProcessGroupNCCL's watchdog thread itself was stuck (a CUDA or NCCL call that hung, not a "
                    "collective's timeout)", None))
    if kinds["nccl_failed"]:
        out.append(("NCCL operations failed or timed out", None))
    if kinds["nccl_cuda"]:
        hosts = sorted({short(t.host_of(e)) or "?" for e in kinds["nccl_cuda"]})
        out.append((f"NCCL hit a CUDA failure ('{kinds['nccl_cuda'][0].fields['message']}') on "
                    f"{', '.join(hosts)}", "software"))
    soft = [e for e in kinds["cuda_error"] if not e.fields.get("hardware")]
    if soft:
        out.append((f"CUDA error: {soft[0].fields['message']}", "software"))
    if kinds["oom_kill"]:
        out.append(("Slurm's OOM killer ended tasks", "software"))
    if kinds["torchrun_failure"]:
        out.append((f"{len(kinds['torchrun_failure'])} ranks failed at the same time (torchrun's 'root cause' is "
                    "only the first in its list)", None))
    if kinds["ib_completion"] or kinds["nccl_warn"]:
        out.append(("NCCL warned: " + (kinds["nccl_warn"] + kinds["ib_completion"])[0].fields["message"][:160],
                    None))
    if kinds["srun_task"]:
        out.append(("srun's tasks were killed", None))
    return out


def _symptom_steps(events: Sequence[LogEvent]) -> list[tuple[str, Step]]:
    kinds = ("heartbeat", "pg_progress", "watchdog_timeout", "nccl_failed", "nccl_cuda", "cuda_error", "oom_kill",
             "torchrun_failure", "ib_completion", "nccl_warn", "srun_task")
    out = []
    for kind in kinds:
        out += [(kind, _step("s", e)) for e in [e for e in events if e.kind == kind][:2]]
    return out[:8]


def _step(step: str, e: LogEvent) -> Step:
    return Step(step, e.source, e.line, e.text)


def _map_step(p: RankPlace) -> Step:
    return Step("map", p.event.source, p.event.line,
                f"rank {p.rank} ran on {p.host}" + (f" ({p.gpu_text()})" if p.gpu_text() else "") + ": "
                + p.event.text)


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
