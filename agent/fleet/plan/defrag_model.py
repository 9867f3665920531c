"""The defrag model (`gpuwarden plan defrag`, agent/fleet/plan/defrag.py): the nodes, the jobs on them and which may be
moved, and the least disruptive plan that frees S healthy nodes in one rack (NVLink domain): the fewest jobs moved,
then the least work lost (node-hours), ties by rack name."""
from __future__ import annotations

import itertools
import math
from dataclasses import field
from typing import Iterable, Sequence

from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import Service

MAX_SLICE = 10_000
# Node checks per rack by the exact search of shared nodes (about a second; whole-node racks take a knapsack of
# jobs x k x S steps under the same bound); past it a greedy plan, marked not exact.
MAX_SEARCH = 2_000_000
MAX_RACK_NODES = 1024  # a domain with more nodes than this is not an NVLink domain (NVL576: 144 trays); not planned
MAX_CANDIDATES = 4096  # jobs on one rack's nodes that could be moved; past it the rack is not planned
# A job that holds its nodes: anything but pending and the end states (a finished job stays in squeue MinJobAge
# seconds with its node list).
_ENDED = frozenset({"PENDING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                    "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"})
# Only these can be preempted off their nodes; a COMPLETING or CONFIGURING job is left to finish what it does.
_MOVABLE_STATES = frozenset({"RUNNING", "SUSPENDED"})


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
