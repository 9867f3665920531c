"""The lines of reasoning of `gpuwarden explain` (agent/jobs/explain.py), each from the job's log events and tables to
a `_Pointer` or None: (a) gpuwarden's findings on the job's nodes mapped to ranks, and a GPU failure the log itself
shows; (b) the rank that stalled; (c) the peer NCCL's errors point to; (d) the first failure in time; and the
symptoms said where none of them names a place. Pure."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from gpuwarden.agent.jobs.explain_places import Step, _Pointer, _step, _Tables, culprit, short
from gpuwarden.agent.jobs.joblog import LogEvent
from gpuwarden.agent.jobs.joblog_lines import bus_id
from gpuwarden.agent.jobs.node_evidence import NodeEvidence

# Node findings that can end a job's collectives or say its GPU/port failed: FAIL, or a recommended action of at
# least restarting the application.
_SERIOUS_ACTIONS = ("RESTART_APP", "DRAIN", "RESET_GPU", "REBOOT", "SERVICE")


_FLUSH = 5  # IBV_WC_WR_FLUSH_ERR: a queue pair flushed after an earlier error (FACTS.md), a follow-up


_RETRY_EXCEEDED = 12  # IBV_WC_RETRY_EXC_ERR: the NICs could not talk to each other


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
