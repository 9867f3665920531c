"""The defrag advisor, `gpuwarden plan defrag`: which preemptible jobs to move so that one rack (NVLink domain) has S
healthy free nodes for a pending slice, from Slurm's view (`squeue --json`, `sinfo --json`, `scontrol show partition`)
or from files of the same. Least disruptive: the fewest jobs moved, then the least work lost (node-hours: elapsed
time x nodes of each moved job), ties by rack name. It only advises: it never cancels or requeues anything.

Which jobs may be moved: running (or suspended) batch jobs of a preemptible partition (--preemptible-partitions, or by
default those whose PreemptMode requeues or cancels) or QOS (--preemptible-qos); never an interactive job (salloc,
srun: no batch script) nor one of an --interactive-partitions partition, nor a job of any other partition.

Exit codes: 0 a plan; 1 no rack can be freed without touching work that may not be moved (why, per rack); 2 bad
input or flags, or Slurm could not be asked."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import field
from pathlib import Path
from typing import Any, Iterable, Sequence

from gpuwarden.agent.act.adapters.slurm import (
    MAX_HOSTS,
    SlurmAdapter,
    expand_hostlist,
    job_state_words,
    parse_sinfo_json,
    slurm_flag,
    slurm_number,
    valid_name,
)
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.flag_values import parse_float, parse_int
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import Refused, Service, Transient

EXIT_PLAN, EXIT_NO_PLAN, EXIT_INPUT = 0, 1, 2
EXIT_CODES = (("0", "a plan: the rack, the nodes it frees, the jobs to move"),
              ("1", "no rack can be freed without moving work that may not be moved (why, per rack)"),
              ("2", "bad input or flags, or Slurm could not be asked"))

MAX_FILE = 64 << 20  # squeue --json of a full queue on a large cluster stays well under this
MAX_JOBS = 500_000
MAX_SLICE = 10_000
# Node checks per rack by the exact search of shared nodes (about a second; whole-node racks take a knapsack of
# jobs x k x S steps under the same bound); past it a greedy plan, marked not exact.
MAX_SEARCH = 2_000_000
MAX_RACK_NODES = 1024  # a domain with more nodes than this is not an NVLink domain (NVL576: 144 trays); not planned
MAX_CANDIDATES = 4096  # jobs on one rack's nodes that could be moved; past it the rack is not planned
MAX_ELAPSED_S = 10 * 366 * 86400.0  # a start time further back than this is not believed
MAX_PARTITIONS = 10_000

# A job that holds its nodes: anything but pending and the end states (a finished job stays in squeue MinJobAge
# seconds with its node list).
_ENDED = frozenset({"PENDING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                    "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"})
# Only these can be preempted off their nodes; a COMPLETING or CONFIGURING job is left to finish what it does.
_MOVABLE_STATES = frozenset({"RUNNING", "SUSPENDED"})
# PreemptMode words that take a job off its nodes (SUSPEND keeps it in the node's memory; GANG time-slices it).
_FREEING_MODES = frozenset({"REQUEUE", "CANCEL"})


# -- the fleet --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    name: str
    domain: str | None
    service: Service
    spare: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class Job:
    id: str
    partition: str
    nodes: tuple[str, ...]
    state: str = "RUNNING"
    batch: bool = True  # has a batch script (sbatch); salloc/srun jobs have none
    requeue: bool = True
    qos: str = ""
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Policy:
    """Which jobs may be moved, and whether spares count as free nodes."""
    preemptible_partitions: frozenset[str] = frozenset()
    preemptible_qos: frozenset[str] = frozenset()
    interactive_partitions: frozenset[str] = frozenset()
    use_spares: bool = False

    def movable(self, job: Job) -> tuple[bool, str]:
        """(may this job be moved, why not)."""
        if job.state not in _MOVABLE_STATES:
            return False, f"{job.state.lower()}"
        if not job.batch:
            return False, "interactive (no batch script)"
        if job.partition in self.interactive_partitions:
            return False, f"interactive partition {job.partition}"
        if job.partition in self.preemptible_partitions or (job.qos and job.qos in self.preemptible_qos):
            return True, ""
        return False, f"not preemptible (partition {job.partition}{', QOS ' + job.qos if job.qos else ''})"


@dataclass(frozen=True)
class Move:
    job: Job
    action: str  # "requeue" (Slurm puts it back in the queue) or "cancel" (not requeueable: its work is lost)

    @property
    def node_hours(self) -> float:
        return self.job.elapsed_s / 3600.0 * len(self.job.nodes)


@dataclass(frozen=True)
class RackPlan:
    rack: str
    feasible: bool
    slice_nodes: tuple[str, ...] = ()
    free_now: tuple[str, ...] = ()
    freed: tuple[str, ...] = ()
    moves: tuple[Move, ...] = ()
    exact: bool = True
    why: str = ""  # why not feasible; for a feasible rack not chosen, filled by plan()

    @property
    def cost(self) -> tuple[int, float]:
        return len(self.moves), round(sum(m.node_hours for m in self.moves), 6)


@dataclass(frozen=True)
class Plan:
    slice_size: int
    chosen: RackPlan | None
    racks: tuple[RackPlan, ...]
    no_domain: tuple[str, ...] = field(default=())  # nodes in no NVLink domain: not considered

    @property
    def why(self) -> str:
        if self.chosen is not None:
            return ""
        if not self.racks:
            return "no node carries an NVLink domain (publish them: gpuwarden_domain_<d> features)"
        return "; ".join(f"{r.rack}: {r.why}" for r in self.racks)


def _usable(node: Node, policy: Policy) -> tuple[bool, str]:
    """(is this node healthy and may take the slice once empty, why not)."""
    if node.spare:
        if policy.use_spares and node.service is Service.DRAINED:
            return True, ""
        return False, "spare" if not policy.use_spares else f"spare, {node.service.value}"
    if node.service is Service.IN_SERVICE:
        return True, ""
    return False, node.service.value + (f" ({node.reason})" if node.reason else "")


def plan_rack(rack: str, nodes: Sequence[Node], jobs: Sequence[Job], size: int, policy: Policy,
              search_limit: int = MAX_SEARCH) -> RackPlan:
    """The least disruptive set of jobs to move so that `size` of this rack's `nodes` are healthy and free."""
    if len(nodes) > MAX_RACK_NODES:
        return RackPlan(rack, False, why=f"{len(nodes)} nodes: more than an NVLink domain holds ({MAX_RACK_NODES}); "
                                         "not planned")
    usable, held = [], []
    for n in nodes:
        ok, why = _usable(n, policy)
        (usable if ok else held).append((n.name, why))
    names = {n for n, _ in usable}
    on: dict[str, list[Job]] = {n: [] for n in names}
    for job in jobs:
        for n in job.nodes:
            if n in on:
                on[n].append(job)
    free_now = sorted((n for n in names if not on[n]), key=_natural)
    blocked: dict[str, str] = {}
    for n in sorted(names, key=_natural):
        for job in on[n]:
            ok, why = policy.movable(job)
            if not ok:
                blocked[n] = f"job {job.id} {why}"
                break
    freeable = sorted((n for n in names if on[n] and n not in blocked), key=_natural)
    need = size - len(free_now)
    if len(free_now) + len(freeable) < size:
        parts = [f"{len(nodes)} nodes", f"{len(names)} healthy"]
        if held:
            parts.append("held out: " + ", ".join(f"{n} {w}" for n, w in sorted(held, key=lambda h: _natural(h[0]))[:8])
                         + (" ..." if len(held) > 8 else ""))
        if blocked:
            parts.append("not to be moved: " + ", ".join(f"{n} {w}" for n, w in list(blocked.items())[:8])
                         + (" ..." if len(blocked) > 8 else ""))
        return RackPlan(rack, False, free_now=tuple(free_now),
                        why=f"{len(free_now) + len(freeable)} of {size} nodes can be freed ({'; '.join(parts)})")
    if need <= 0:
        return RackPlan(rack, True, tuple(free_now[:size]), tuple(free_now))
    candidates = sorted({j for n in freeable for j in on[n]}, key=lambda j: _job_key(j))
    if len(candidates) > MAX_CANDIDATES:
        return RackPlan(rack, False, free_now=tuple(free_now),
                        why=f"{len(candidates)} jobs could be moved: more than {MAX_CANDIDATES}; not planned")
    index = {j.id: i for i, j in enumerate(candidates)}
    # node -> the candidate jobs that must all move to free it
    needs = [frozenset(index[j.id] for j in on[n]) for n in freeable]
    best, exact = _search(candidates, needs, need, search_limit)
    freed = [n for n, req in zip(freeable, needs, strict=True) if req <= set(best)]
    slice_nodes = tuple(free_now + freed[: size - len(free_now)])
    moves = tuple(Move(candidates[i], "requeue" if candidates[i].requeue else "cancel")
                  for i in sorted(best, key=lambda i: _job_key(candidates[i])))
    return RackPlan(rack, True, slice_nodes, tuple(free_now), tuple(freed), moves, exact)


def _natural(name: str) -> tuple:
    """A node name's sort key: n2 before n10."""
    parts, digits, run = [], False, ""
    for c in name:
        if (c.isascii() and c.isdigit()) != digits:
            parts.append(int(run) if digits else run)
            digits, run = not digits, ""
        run += c
    parts.append(int(run) if digits else run)
    return tuple(parts)


def _job_key(job: Job) -> tuple:
    return (int(job.id) if job.id.isdigit() else math.inf, job.id)


def _hours(jobs: Sequence[Job], chosen: Iterable[int]) -> float:
    return sum(jobs[i].elapsed_s * len(jobs[i].nodes) for i in chosen)


def _search(jobs: Sequence[Job], needs: Sequence[frozenset[int]], need: int,
            limit: int) -> tuple[tuple[int, ...], bool]:
    """The job set (indices) that frees `need` nodes with the fewest jobs, then the least node-hours: every set of k
    jobs for k = 1, 2, ... until one frees enough, within `limit` node checks in all (a set costs one check per
    node); past that a greedy set, reported as not exact."""
    if all(len(req) == 1 for req in needs):
        exclusive = _exclusive(jobs, needs, need, limit)
        if exclusive is not None:
            return exclusive, True
    work = 0
    # k jobs free at most the nodes the k most widespread of them are on: smaller sets are not tried
    spread = sorted((sum(1 for req in needs if i in req) for i in range(len(jobs))), reverse=True)
    reach = list(itertools.accumulate(spread))
    for k in range(1, len(jobs) + 1):
        if reach[k - 1] < need:
            continue
        found: tuple[int, ...] | None = None
        for combo in itertools.combinations(range(len(jobs)), k):
            work += len(needs)
            if work > limit:
                return _greedy(jobs, needs, need), False
            chosen = set(combo)
            if sum(1 for req in needs if req <= chosen) >= need and (
                    found is None or _hours(jobs, combo) < _hours(jobs, found)):
                found = combo
        if found is not None:
            return found, True
    raise AssertionError("the freeable nodes were counted as enough")  # every job moved frees them all


def _exclusive(jobs: Sequence[Job], needs: Sequence[frozenset[int]], need: int,
               limit: int) -> tuple[int, ...] | None:
    """The search when each node holds one job (the usual case on GPU racks: whole nodes to a job): the fewest jobs is
    the k largest by node count, and the least node-hours among k-job sets freeing `need` nodes is a knapsack over
    (jobs taken, nodes freed), one pass a job. None past `limit` steps."""
    weight = [0] * len(jobs)
    for req in needs:
        (i,) = req
        weight[i] += 1
    reach = list(itertools.accumulate(sorted(weight, reverse=True)))
    k = next(j + 1 for j, r in enumerate(reach) if r >= need)
    if len(jobs) * k * (need + 1) > limit:
        return None
    # best[j][n]: (node-hours x 3600, the job indices) of the cheapest j jobs freeing n nodes (n capped at need)
    best: list[list[tuple[float, tuple[int, ...]] | None]] = [[None] * (need + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, ())
    for i, w in enumerate(weight):
        cost = jobs[i].elapsed_s * len(jobs[i].nodes)
        for j in range(min(k, i + 1), 0, -1):
            for n in range(need, -1, -1):
                prev = best[j - 1][n]
                if prev is None:
                    continue
                m = min(need, n + w)
                cand = (prev[0] + cost, prev[1] + (i,))
                if best[j][m] is None or cand < best[j][m]:
                    best[j][m] = cand
    found = best[k][need]
    assert found is not None  # the k largest reach `need`
    return found[1]


def _greedy(jobs: Sequence[Job], needs: Sequence[frozenset[int]], need: int) -> tuple[int, ...]:
    """Each step the job that alone frees the most nodes, then touches the most, then has run the least: one pass
    over the node/job pairs a step, at most one step a job."""
    remaining = [set(req) for req in needs]
    freed = sum(1 for r in remaining if not r)
    chosen: set[int] = set()
    while freed < need:
        sole: dict[int, int] = {}
        touch: dict[int, int] = {}
        for r in remaining:
            for i in r:
                touch[i] = touch.get(i, 0) + 1
            if len(r) == 1:
                (i,) = r
                sole[i] = sole.get(i, 0) + 1
        best = min(touch, key=lambda i: (-sole.get(i, 0), -touch[i], jobs[i].elapsed_s * len(jobs[i].nodes), i))
        chosen.add(best)
        for r in remaining:
            if best in r:
                r.discard(best)
                freed += not r
    return tuple(sorted(chosen))


def plan(nodes: Sequence[Node], jobs: Sequence[Job], size: int, policy: Policy,
         search_limit: int = MAX_SEARCH) -> Plan:
    """The plan for a slice of `size` nodes: each rack's least disruptive way to free it, and the rack whose way moves
    the fewest jobs, then loses the fewest node-hours, then comes first by name."""
    if not 1 <= size <= MAX_SLICE:
        raise ConfigError(f"--slice: {size} is not in 1..{MAX_SLICE}")
    racks: dict[str, list[Node]] = {}
    no_domain = []
    for n in nodes:
        if n.domain:
            racks.setdefault(n.domain, []).append(n)
        else:
            no_domain.append(n.name)
    rack_of = {n.name: n.domain for n in nodes if n.domain}
    on_rack: dict[str, list[Job]] = {r: [] for r in racks}
    for j in jobs:
        if j.state not in _ENDED:
            for r in {rack_of[n] for n in j.nodes if n in rack_of}:
                on_rack[r].append(j)
    plans = [plan_rack(r, racks[r], on_rack[r], size, policy, search_limit) for r in sorted(racks)]
    feasible = sorted((p for p in plans if p.feasible), key=lambda p: (p.cost, p.rack))
    chosen = feasible[0] if feasible else None
    out = []
    for p in plans:
        if p.feasible and p is not chosen:
            (jc, hc), (jo, ho) = chosen.cost, p.cost
            if jo != jc:
                why = f"needs {jo} job(s) moved, {chosen.rack} {jc}"
            elif ho != hc:
                why = f"{ho:.2f} node-hours of work lost, {chosen.rack} {hc:.2f}"
            else:
                why = f"as good as {chosen.rack}, which comes first by name"
            p = RackPlan(p.rack, True, p.slice_nodes, p.free_now, p.freed, p.moves, p.exact, why)
        out.append(p)
    return Plan(size, next((p for p in out if chosen and p.rack == chosen.rack), None), tuple(out),
                tuple(sorted(no_domain)))


# -- reading Slurm's output -------------------------------------------------------------------------------------------
def parse_squeue_json(text: str, source: str, now: float) -> list[Job]:
    """The jobs of `squeue --json` (Slurm 22.05's shape; newer shapes where they differ only in how a number or a
    state is written). Raises ConfigError naming `source` on anything that is not that."""
    if len(text) > MAX_FILE:
        raise ConfigError(f"{source}: more than {MAX_FILE >> 20} MiB; not read")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{source}: not JSON ({str(exc)[:100]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: not squeue --json output (not a JSON object)")
    errors = doc.get("errors")
    if isinstance(errors, list) and errors:
        first = errors[0] if isinstance(errors[0], dict) else {}
        what = str(first.get("error") or first.get("description") or "error")[:200]
        raise ConfigError(f"{source}: squeue reports an error ({what}): slurmctld not reached?")
    entries = doc.get("jobs")
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: not squeue --json output (no \"jobs\" list)")
    if len(entries) > MAX_JOBS:
        raise ConfigError(f"{source}: more than {MAX_JOBS} jobs; not read")
    jobs: dict[str, Job] = {}
    hosts = 0
    for i, entry in enumerate(entries):
        where = f"{source}: jobs[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: not an object")
        jid = slurm_number(entry.get("job_id"))
        if jid is None or jid != int(jid) or jid >= 1 << 32:
            raise ConfigError(f"{where}: job_id {str(entry.get('job_id'))[:40]!r} is not a job id")
        jid_s = str(int(jid))
        if jid_s in jobs:
            raise ConfigError(f"{where}: job {jid_s} listed twice")
        states = job_state_words(entry.get("job_state"))
        if not states:
            raise ConfigError(f"{where}: job {jid_s} has no job_state")
        nodes_text = entry.get("nodes")
        if not isinstance(nodes_text, str) and nodes_text is not None:
            raise ConfigError(f"{where}: job {jid_s}: nodes is not a hostlist")
        try:
            nodes = tuple(dict.fromkeys(expand_hostlist(nodes_text or "", MAX_HOSTS - hosts)))
        except ValueError as exc:
            raise ConfigError(f"{where}: job {jid_s}: nodes {nodes_text[:80]!r}: {exc}") from None
        hosts += len(nodes)
        partition = entry.get("partition", "")
        if not isinstance(partition, str) or len(partition) > 1024:
            raise ConfigError(f"{where}: job {jid_s}: partition is not a name")
        qos = entry.get("qos", "")
        start = slurm_number(entry.get("start_time"))
        elapsed = 0.0
        if "RUNNING" in states or "SUSPENDED" in states:
            if start is None:
                raise ConfigError(f"{where}: job {jid_s} is {states[0].lower()} with no start_time (a number)")
            elapsed = max(0.0, now - start)
            if elapsed > MAX_ELAPSED_S:
                raise ConfigError(f"{where}: job {jid_s}: start_time {start:.0f} is more than ten years before now")
            suspended = slurm_number(entry.get("suspend_time"))
            if "SUSPENDED" in states and suspended is not None and suspended >= start:
                elapsed = max(0.0, suspended - start)  # its work stopped growing when it was suspended
        state = "COMPLETING" if "COMPLETING" in states else states[0]
        jobs[jid_s] = Job(jid_s, partition, nodes, state, slurm_flag(entry.get("batch_flag"), False),
                          slurm_flag(entry.get("requeue"), False), qos[:256] if isinstance(qos, str) else "", elapsed)
    return list(jobs.values())


def parse_partitions(text: str, source: str) -> dict[str, set[str]]:
    """partition -> its PreemptMode words, from `scontrol show partition -o` (one partition a line, Key=Value)."""
    if len(text) > MAX_FILE:
        raise ConfigError(f"{source}: more than {MAX_FILE >> 20} MiB; not read")
    out: dict[str, set[str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) >= MAX_PARTITIONS:
            raise ConfigError(f"{source}: more than {MAX_PARTITIONS} partitions; not read")
        name = mode = None
        for token in line[:65536].split():
            key, eq, value = token.partition("=")
            if key == "PartitionName" and eq:
                name = value
            elif key == "PreemptMode" and eq:
                mode = value
        if not name or not valid_name(name, 256) or mode is None:
            raise ConfigError(f"{source}:{number}: not a `scontrol show partition -o` line (PartitionName=, "
                              f"PreemptMode=)")
        out[name] = {w for w in mode.upper().split(",")[:16] if w}
    return out


def nodes_from_sinfo(text: str, source: str) -> list[Node]:
    """The nodes of `sinfo --json` (agent/act/adapters/slurm.py's reading: state, spare, NVLink domain); a ConfigError
    that starts with `source` otherwise."""
    try:
        parsed = parse_sinfo_json(text)
    except (Transient, Refused) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return [Node(n.view.name, n.view.domain, n.view.service, n.view.spare, n.view.reason) for n in parsed]


def preemptible_partitions(modes: dict[str, set[str]]) -> frozenset[str]:
    """The partitions whose PreemptMode takes a job off its nodes (REQUEUE or CANCEL)."""
    return frozenset(p for p, words in modes.items() if words & _FREEING_MODES)


# -- the command -------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slice", type=str, required=True, metavar="S",
                   help="nodes the pending slice needs, all in one rack (NVLink domain)")
    p.add_argument("--squeue", type=Path, metavar="FILE", help="`squeue --json` saved to a file (with --sinfo; "
                                                               "default: ask Slurm now)")
    p.add_argument("--sinfo", type=Path, metavar="FILE", help="`sinfo --json` saved to a file (with --squeue)")
    p.add_argument("--partitions", type=Path, metavar="FILE",
                   help="`scontrol show partition -o` saved to a file: the PreemptMode of each partition, for the "
                        "default of --preemptible-partitions")
    p.add_argument("--preemptible-partitions", action="append", default=[], metavar="P[,P…]",
                   help="jobs of these partitions may be moved (default: the partitions whose PreemptMode is "
                        "REQUEUE or CANCEL)")
    p.add_argument("--preemptible-qos", action="append", default=[], metavar="Q[,Q…]",
                   help="jobs of these QOS may be moved too")
    p.add_argument("--interactive-partitions", action="append", default=[], metavar="P[,P…]",
                   help="jobs of these partitions are never moved (salloc/srun jobs never are, wherever they run)")
    p.add_argument("--use-spares", action="store_true",
                   help="count the rack's spares (drained `gpuwarden: spare`) as free nodes")
    p.add_argument("--now", type=str, metavar="EPOCH",
                   help="the time the elapsed time of jobs is counted to (default: now; for saved files, when "
                        "they were saved)")
    p.add_argument("--slurm-conf", type=Path, metavar="FILE", help="the cluster to ask (default: SLURM_CONF, or "
                                                                   "Slurm's own default)")
    if not any(a.dest == "json" for a in p._actions):
        p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def _names(values: Sequence[str], flag: str) -> frozenset[str]:
    out = set()
    for v in values:
        for name in v.split(","):
            name = name.strip()
            if not name:
                continue
            if not valid_name(name, 256):
                raise ConfigError(f"{flag}: {name[:40]!r} is not a partition or QOS name")
            out.add(name)
    return frozenset(out)


def _read(path: Path, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE:
        raise ConfigError(f"{flag} {path}: more than {MAX_FILE >> 20} MiB; not read")
    return data.decode(errors="replace")


def gather(args: argparse.Namespace, now: float) -> tuple[list[Node], list[Job], dict[str, set[str]] | None]:
    """The nodes, the jobs and (when known) each partition's PreemptMode: from the files given, else from Slurm."""
    if (args.squeue is None) != (args.sinfo is None):
        raise ConfigError("--squeue and --sinfo go together (both files, or neither to ask Slurm)")
    if args.squeue is not None:
        nodes = nodes_from_sinfo(_read(args.sinfo, "--sinfo"), str(args.sinfo))
        jobs = parse_squeue_json(_read(args.squeue, "--squeue"), str(args.squeue), now)
        modes = (parse_partitions(_read(args.partitions, "--partitions"), str(args.partitions))
                 if args.partitions is not None else None)
        return nodes, jobs, modes
    adapter = SlurmAdapter(slurm_conf=str(args.slurm_conf) if args.slurm_conf else None)
    try:
        nodes = nodes_from_sinfo(adapter.read("sinfo", ["--json"]), "Slurm could not be asked")
        jobs = parse_squeue_json(adapter.read("squeue", ["--json"]), "squeue --json", now)
        modes = (parse_partitions(adapter.read("scontrol", ["show", "partition", "-o"]), "scontrol show partition")
                 if args.partitions is None else
                 parse_partitions(_read(args.partitions, "--partitions"), str(args.partitions)))
    except (Transient, Refused) as exc:
        raise ConfigError(f"Slurm could not be asked: {exc}") from None
    return nodes, jobs, modes


def policy_from(args: argparse.Namespace, modes: dict[str, set[str]] | None) -> Policy:
    partitions = _names(args.preemptible_partitions, "--preemptible-partitions")
    qos = _names(args.preemptible_qos, "--preemptible-qos")
    if not partitions and not qos:
        if modes is None:
            raise ConfigError("which jobs may be moved? give --preemptible-partitions (or --preemptible-qos), or "
                              "--partitions FILE (`scontrol show partition -o`) to take those whose PreemptMode is "
                              "REQUEUE or CANCEL")
        partitions = preemptible_partitions(modes)
    return Policy(partitions, qos, _names(args.interactive_partitions, "--interactive-partitions"),
                  bool(args.use_spares))


def to_dict(p: Plan, policy: Policy) -> dict[str, Any]:
    def move(m: Move) -> dict[str, Any]:
        return {"job": m.job.id, "partition": m.job.partition, "qos": m.job.qos or None, "action": m.action,
                "nodes": list(m.job.nodes), "elapsed_s": round(m.job.elapsed_s, 1),
                "node_hours": round(m.node_hours, 4)}

    c = p.chosen
    return {
        "slice": p.slice_size,
        "plan": c is not None,
        "rack": c.rack if c else None,
        "nodes": list(c.slice_nodes) if c else [],
        "free_now": list(c.free_now) if c else [],
        "freed": list(c.freed) if c else [],
        "moves": [move(m) for m in c.moves] if c else [],
        "jobs_moved": c.cost[0] if c else None,
        "node_hours_lost": round(c.cost[1], 4) if c else None,
        "exact": c.exact if c else None,
        "commands": _commands(c) if c else [],
        "why": p.why or None,
        "racks": [{"rack": r.rack, "feasible": r.feasible, "chosen": c is not None and r.rack == c.rack,
                   "jobs_moved": r.cost[0] if r.feasible else None,
                   "node_hours_lost": round(r.cost[1], 4) if r.feasible else None,
                   "jobs": [m.job.id for m in r.moves], "why": r.why or None} for r in p.racks],
        "nodes_without_domain": list(p.no_domain),
        "preemptible_partitions": sorted(policy.preemptible_partitions),
        "preemptible_qos": sorted(policy.preemptible_qos),
        "use_spares": policy.use_spares,
        "advice_only": True,
    }


def _commands(c: RackPlan) -> list[str]:
    """What an operator would run to carry the plan out (never run here)."""
    out = []
    for action, verb in (("requeue", "scontrol requeue"), ("cancel", "scancel")):
        ids = [m.job.id for m in c.moves if m.action == action]
        if ids:
            out.append(f"{verb} {','.join(ids) if action == 'requeue' else ' '.join(ids)}")
    return out


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}-" if d else "") + f"{h}:{m:02d}:{s:02d}"


def render(p: Plan) -> str:
    lines = []
    c = p.chosen
    if c is None:
        lines.append(f"no rack can give a slice of {p.slice_size} nodes without moving work that may not be moved")
        for r in p.racks:
            lines.append(f"  {r.rack}: {r.why}")
        if not p.racks:
            lines.append(f"  {p.why}")
    else:
        lines.append(f"slice of {p.slice_size} nodes: rack {c.rack}, nodes {' '.join(c.slice_nodes)}")
        lines.append(f"  free now: {' '.join(c.free_now) or '-'}; freed by the moves: {' '.join(c.freed) or '-'}")
        if c.moves:
            jobs, hours = c.cost
            lines.append(f"  move {jobs} job(s), {hours:.2f} node-hours of work lost"
                         + ("" if c.exact else " (search bound reached: a good plan, not proven the best)"))
            rows = [("JOB", "PARTITION", "ACTION", "ELAPSED", "NODE-HOURS", "NODES")]
            rows += [(m.job.id, m.job.partition, m.action, _elapsed(m.job.elapsed_s), f"{m.node_hours:.2f}",
                      ",".join(m.job.nodes)) for m in c.moves]
            widths = [max(len(r[i]) for r in rows) for i in range(5)]
            for r in rows:
                lines.append("    " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[5])
            lines.append("  to carry it out (not done here): " + "; ".join(_commands(c)))
        else:
            lines.append("  nothing to move")
        others = [r for r in p.racks if r is not c]
        if others:
            lines.append("other racks:")
            lines += [f"  {r.rack}: {r.why}" for r in others]
    if p.no_domain:
        lines.append(f"nodes in no NVLink domain, not considered: {' '.join(p.no_domain[:20])}"
                     + (" ..." if len(p.no_domain) > 20 else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    size = parse_int(args.slice, "--slice", 1, MAX_SLICE)
    now = parse_float(args.now, "--now", 0, 1e11) if args.now is not None else time.time()
    nodes, jobs, modes = gather(args, now)
    policy = policy_from(args, modes)
    result = plan(nodes, jobs, size, policy)
    if getattr(args, "json", False):
        print(json.dumps(to_dict(result, policy), indent=2))
    else:
        print(render(result))
    return EXIT_PLAN if result.chosen is not None else EXIT_NO_PLAN
