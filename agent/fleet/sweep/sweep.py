"""`gpuwarden sweep`: multi-node NCCL collectives over idle nodes, judged by regime, with the culprit of a failing
group found by group testing, and a verdict per node for its daemon.

One sweep:
1. **Which nodes**: the scheduler's idle nodes (in service, no work running: `jobs == 0`; unknown is not idle; never
   a drained, quarantined or down node; spares only with `include_spares` on the local adapter, which holds them
   for the sweep so they are never taken as spares mid-sweep). `--nodes` narrows the choice, never widens it.
2. **First rounds** (`plan_phases`): the *domain* round tests each NVLink domain's idle nodes in groups of about
   `group_nodes` (the traffic stays on NVLink); the *fabric* round (`cross_domain`) groups nodes of different
   domains, one from each, so every collective crosses the InfiniBand fabric. Nodes with no domain (HGX: one node
   is its own NVLink domain) are tested only across the fabric. Within a round the groups are disjoint and run at
   once.
3. **Judgement** (agent/fleet/sweep/criteria.py): p95 latency of small messages, bus bandwidth of large ones, each
   against a baseline with its source; the MB range on its own.
4. **Localisation** (agent/fleet/sweep/localise.py), per round kind: the failing groups and the nodes of passing ones go
   to the group tester, which asks for more (disjoint) collectives until each failing group, less what it names, runs
   clean. A round kind whose every group failed blames nobody: a fleet-wide signal (a fabric-wide fault, a bad
   baseline) must never drain the fleet; it is reported, undecided.
5. **Verdicts**: `<results_dir>/nodes/<node>.json` for every node the sweep could judge (findings for a culprit,
   none for a node that passed, which clears an earlier sweep's finding), and the whole sweep in
   `<results_dir>/reports/<id>.json`. The node's daemon reads its file (checks/nccl_sweep.py), so a sweep finding
   goes through the node's own state machine, circuit breaker and remediation like any other.

A sweep gives way to real work: it runs as a low-priority job the scheduler may preempt; a preempted or unstarted
collective decides nothing (its nodes are left as they were), and a SIGTERM ends every job it started and still
writes what it learned (a partial report)."""
from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView, Service
from gpuwarden.agent.core.sweep_names import CHECK_NAME, FORMAT, valid_name
from gpuwarden.agent.fleet.sweep.localise import Localiser
from gpuwarden.agent.fleet.sweep.model import GroupRun, Outcome

log = logs.get_logger("gpuwarden.sweep")

# The code of a node culprit's finding, by the worst outcome of the failing collectives that name it.
CODES = {Outcome.WRONG: "sweep-wrong-results", Outcome.HUNG: "sweep-hang", Outcome.FAILED: "sweep-failed",
         Outcome.SLOW: "sweep-slow"}
WHAT = {Outcome.WRONG: "returned wrong values (silent data corruption)",
        Outcome.HUNG: "hung (the collective never finished)",
        Outcome.FAILED: "crashed or failed", Outcome.SLOW: "ran below its baseline"}
_RANK = {Outcome.WRONG: 4, Outcome.HUNG: 3, Outcome.FAILED: 2, Outcome.SLOW: 1}
EXIT_CLEAN, EXIT_CULPRITS, EXIT_UNDECIDED = 0, 1, 2


# -- which nodes, which groups ---------------------------------------------------------------------------------------
def idle_nodes(views: Sequence[NodeView], include_spares: bool = False) -> list[NodeView]:
    """The nodes a sweep may use: in service with no work (unknown work is not idle), or healthy spares if asked."""
    out = []
    for v in views:
        if v.quarantined or v.service in (Service.DOWN, Service.UNKNOWN) or not valid_name(v.name):
            continue
        if v.spare and include_spares and v.reason is not None and v.service in (Service.DRAINED, Service.IN_SERVICE):
            out.append(v)
        elif not v.spare and v.service is Service.IN_SERVICE and v.jobs == 0:
            out.append(v)
    return out


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _chunks(names: Sequence[str], size: int) -> list[tuple[str, ...]]:
    """`names` cut into groups of about `size` (near-equal sizes, none of one node)."""
    if len(names) < 2:
        return []
    count = max(1, round(len(names) / max(2, size)))
    base, extra = divmod(len(names), count)
    if base < 2:
        count = len(names) // 2
        base, extra = divmod(len(names), count)
    out, at = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        out.append(tuple(names[at:at + n]))
        at += n
    return out


@dataclass(frozen=True)
class Phase:
    name: str  # "domain": within NVLink domains; "fabric": across them (InfiniBand)
    groups: tuple[tuple[str, ...], ...]


def plan_phases(nodes: Sequence[NodeView], group_nodes: int, cross_domain: bool) -> list[Phase]:
    """The first rounds: groups within each NVLink domain, then groups across domains (one node of each domain per
    group, so every collective crosses the fabric). Deterministic: names in natural order."""
    by_domain: dict[str | None, list[str]] = {}
    for v in sorted(nodes, key=lambda v: _natural(v.name)):
        by_domain.setdefault(v.domain, []).append(v.name)
    phases = []
    domain_groups = [g for d, names in sorted(by_domain.items(), key=lambda kv: _natural(kv[0] or ""))
                     if d is not None for g in _chunks(names, group_nodes)]
    if domain_groups:
        phases.append(Phase("domain", tuple(domain_groups)))
    # Across the fabric: nodes dealt round-robin into the groups, the largest domain first and the deal carrying on
    # across domains, with no more groups than nodes outside the largest domain: every group then holds nodes of at
    # least two domains (its traffic crosses the fabric). Nodes with no domain are each a domain of their own.
    columns = [names for d, names in by_domain.items() if d is not None] + [[n] for n in by_domain.get(None, [])]
    columns.sort(key=lambda c: (-len(c), _natural(c[0])))
    total = sum(len(c) for c in columns)
    if cross_domain and len(columns) >= 2:
        count = max(1, min(round(total / max(2, group_nodes)), total - len(columns[0]), total // 2))
        groups: list[list[str]] = [[] for _ in range(count)]
        for i, name in enumerate(n for c in columns for n in c):
            groups[i % count].append(name)
        phases.append(Phase("fabric", tuple(tuple(sorted(g, key=_natural)) for g in groups if len(g) >= 2)))
    return [p for p in phases if p.groups]


# -- one sweep -------------------------------------------------------------------------------------------------------
@dataclass
class Collective:
    """One collective the sweep ran."""
    phase: str
    round: int
    purpose: str  # "sweep" (a first-round group) | "localise"
    nodes: tuple[str, ...]
    outcome: Outcome
    reasons: tuple[str, ...]
    figures: dict[str, Any]
    ended: str
    duration_s: float
    job_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "round": self.round, "purpose": self.purpose, "nodes": list(self.nodes),
                "outcome": self.outcome.value, "reasons": list(self.reasons), "figures": self.figures,
                "ended": self.ended, "duration_s": round(self.duration_s, 3), "job_id": self.job_id}


@dataclass
class Report:
    sweep_id: str
    started: float
    launcher: str
    candidates: list[str] = field(default_factory=list)
    tests: list[Collective] = field(default_factory=list)
    culprit_nodes: dict[str, str] = field(default_factory=dict)  # node -> finding code
    culprit_links: list[tuple[str, str]] = field(default_factory=list)
    unresolved: set[str] = field(default_factory=set)
    passed: set[str] = field(default_factory=set)
    undecided: list[str] = field(default_factory=list)  # why part of the sweep decided nothing
    partial: str | None = None  # why the sweep stopped early (a signal), None: it ran to its end
    ended: float | None = None

    @property
    def exit_code(self) -> int:
        if self.culprit_nodes or self.culprit_links:
            return EXIT_CULPRITS
        if self.undecided or self.unresolved or self.partial or not self.tests:
            return EXIT_UNDECIDED
        return EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "sweep_id": self.sweep_id, "started": self.started, "ended": self.ended,
                "launcher": self.launcher, "candidates": self.candidates, "partial": self.partial,
                "culprit_nodes": dict(sorted(self.culprit_nodes.items())),
                "culprit_links": [list(link) for link in self.culprit_links],
                "unresolved": sorted(self.unresolved, key=_natural), "passed": sorted(self.passed, key=_natural),
                "undecided": self.undecided, "exit_code": self.exit_code,
                "tests": [t.to_dict() for t in self.tests]}


Judge = Callable[[GroupRun, str], tuple[Outcome, tuple[str, ...], dict[str, Any]]]


class Sweep:
    """One sweep over `candidates`. `launcher.run_groups(groups, argv, timeout_s)` runs disjoint groups at once;
    `judge(run, phase)` turns a GroupRun into (outcome, reasons, figures); `stop` ends the sweep between rounds
    (the launcher's `cancel_all` ends what runs)."""

    def __init__(self, candidates: Sequence[NodeView], settings: Mapping[str, Any], launcher: Any, judge: Judge,
                 *, sweep_id: str | None = None, stop: threading.Event | None = None,
                 on_result: Callable[[Collective], None] | None = None, clock: Callable[[], float] = time.time):
        self.candidates = list(candidates)
        self.settings = settings
        self.launcher = launcher
        self.judge = judge
        self.stop = stop or threading.Event()
        self.on_result = on_result
        self.clock = clock
        self.report = Report(sweep_id or new_sweep_id(clock()), clock(), getattr(launcher, "name", "?"),
                             sorted((v.name for v in candidates), key=_natural))
        self._round = 0

    def run(self) -> Report:
        s = self.settings
        planned = [p.name for p in plan_phases(self.candidates, int(s["group_nodes"]), bool(s["cross_domain"]))]
        if not planned:
            self.report.undecided.append(f"{len(self.candidates)} idle node(s) that can be grouped: a collective "
                                         "needs at least 2")
        for name in planned:
            if self.stop.is_set():
                break
            # A node or link found at fault in an earlier round kind is not tested again: it would only fail the
            # groups it joins, and hide the next fault behind its own.
            blamed = set(self.report.culprit_nodes) | {n for link in self.report.culprit_links for n in link}
            left = [v for v in self.candidates if v.name not in blamed]
            phase = next((p for p in plan_phases(left, int(s["group_nodes"]), bool(s["cross_domain"]))
                          if p.name == name), None)
            if phase is None:
                continue
            first = self._round_of(phase.name, "sweep", list(phase.groups))
            decided = [t for t in first if t.outcome.decided]
            failing = [t.nodes for t in decided if t.outcome.bad]
            good = {n for t in decided if not t.outcome.bad for n in t.nodes}
            self.report.passed |= good
            for t in first:
                if not t.outcome.decided:
                    self.report.undecided.append(f"{phase.name} group {','.join(t.nodes)}: {t.outcome.value} "
                                                 f"({'; '.join(t.reasons) or t.ended})")
            if not failing:
                continue
            if not good:
                self.report.unresolved |= {n for g in failing for n in g}
                self.report.undecided.append(
                    f"{phase.name}: every group that ran failed ({len(failing)}): a fleet-wide signal (the fabric, the "
                    "baseline, the software) blames no node; look at the report's reasons")
                continue
            self._localise(Localiser(failing, good, max_tests=int(s["max_tests"])), phase.name, failing)
        if self.stop.is_set() and self.report.partial is None:
            self.report.partial = "stopped by a signal"
        self.report.passed -= set(self.report.culprit_nodes) | self.report.unresolved
        self.report.passed -= {n for link in self.report.culprit_links for n in link}
        self.report.ended = self.clock()
        return self.report

    def _localise(self, localiser: Any, phase: str, failing: Sequence[tuple[str, ...]]) -> None:
        # Stopped midway, what the tester still wanted to know stays open (unresolved): nothing is blamed on a test
        # that did not run.
        while not self.stop.is_set():
            tests = localiser.next_round()
            if not tests:
                break
            for t in self._round_of(phase, "localise", [tuple(x) for x in tests]):
                localiser.record(t.nodes, t.outcome.bad if t.outcome.decided else None)
        found = localiser.result()
        failing_tests = [t for t in self.report.tests if t.phase == phase and t.outcome.bad]
        for node in sorted(found.nodes, key=_natural):
            self.report.culprit_nodes[node] = CODES[self._worst(node, found.nodes, failing_tests)]
        for link in sorted((tuple(sorted(x, key=_natural)) for x in found.links), key=lambda p: _natural(p[0])):
            self.report.culprit_links.append(link)  # type: ignore[arg-type]
        self.report.unresolved |= set(found.unresolved) - set(found.nodes)
        self.report.passed -= set(found.unresolved)
        # The rest of a failing group was cleared by the search (seen to run clean without the culprits).
        named = set(found.nodes) | set(found.unresolved) | {n for link in found.links for n in link}
        self.report.passed |= {n for g in failing for n in g} - named

    @staticmethod
    def _worst(node: str, culprits: Iterable[str], failing: Sequence[Collective]) -> Outcome:
        """The outcome that names `node`: the worst among failing collectives it ran in with no other culprit
        (else among all failing collectives it ran in)."""
        others = set(culprits) - {node}
        mine = [t for t in failing if node in t.nodes]
        alone = [t for t in mine if not others & set(t.nodes)] or mine
        return max((t.outcome for t in alone), key=lambda o: _RANK.get(o, 0), default=Outcome.SLOW)

    def _round_of(self, phase: str, purpose: str, groups: list[tuple[str, ...]]) -> list[Collective]:
        self._round += 1
        log.info("sweep round", sweep=self.report.sweep_id, phase=phase, round=self._round, purpose=purpose,
                 groups=[",".join(g) for g in groups])
        runs = self.launcher.run_groups(groups, list(self.settings["command"]), float(self.settings["timeout_s"]))
        out = []
        for run in runs:
            outcome, reasons, figures = self.judge(run, phase)
            test = Collective(phase, self._round, purpose, tuple(run.nodes), outcome, tuple(reasons), figures,
                              run.ended, run.duration_s, run.job_id)
            self.report.tests.append(test)
            out.append(test)
            log.info("sweep collective", sweep=self.report.sweep_id, nodes=",".join(run.nodes),
                     outcome=outcome.value, ended=run.ended, reasons=list(reasons))
            if self.on_result is not None:
                self.on_result(test)
        return out


def new_sweep_id(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


# -- verdicts --------------------------------------------------------------------------------------------------------
def findings_for(report: Report, link_action: str = "drain") -> dict[str, list[Finding]]:
    """Every node the sweep judged -> its findings ([] for a node that passed)."""
    out: dict[str, list[Finding]] = {n: [] for n in report.passed}
    tests = report.tests

    def evidence(nodes: Iterable[str]) -> dict[str, Any]:
        names = set(nodes)
        mine = [t for t in tests if names <= set(t.nodes)]
        return {"sweep_id": report.sweep_id,
                "failed": [t.to_dict() for t in mine if t.outcome.bad][:8],
                "passed": [{"nodes": list(t.nodes), "figures": t.figures} for t in mine
                           if t.outcome is Outcome.PASS][:8]}

    for node, code in report.culprit_nodes.items():
        outcome = next(o for o, c in CODES.items() if c == code)
        failing = [t for t in tests if node in t.nodes and t.outcome.bad]
        why = "; ".join(dict.fromkeys(r for t in failing for r in t.reasons))[:600]
        out.setdefault(node, []).append(Finding(
            CHECK_NAME, code, Entity.node(node), Status.FAIL,
            f"every multi-node collective with {node} {WHAT[outcome]}, and the same nodes without it ran clean "
            f"(sweep {report.sweep_id}, {len(failing)} failing collective(s)): drain it"
            + (f"; {why}" if why else ""), Action.DRAIN, evidence([node])))
    status, action = (Status.FAIL, Action.DRAIN) if link_action == "drain" else (Status.WARN, Action.MONITOR)
    for a, b in report.culprit_links:
        for me, peer in ((a, b), (b, a)):
            out.setdefault(me, []).append(Finding(
                CHECK_NAME, "sweep-bad-link", Entity.node(me), status,
                f"collectives with both {a} and {b} fail while each runs clean with other nodes: the link between "
                f"them (cables, switch ports, routes) is at fault, not either node (sweep {report.sweep_id})",
                action, {"peer": peer, **evidence([a, b])}))
    for node in report.unresolved - set(out):
        out[node] = [Finding(
            CHECK_NAME, "sweep-unresolved", Entity.node(node), Status.WARN,
            f"a collective with {node} failed and the sweep could not tell which node or link is at fault "
            f"(sweep {report.sweep_id}: "
            f"{report.partial or 'a collective was preempted or not run, or the test budget ran out'})",
            Action.MONITOR, evidence([node]))]
    return out


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically: a reader (the node's daemon) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def write_results(results_dir: Path, report: Report, link_action: str = "drain") -> dict[str, Path]:
    """The report, and one verdict per node the sweep judged; returns node -> its verdict's path."""
    results_dir = Path(results_dir)
    _write_json(results_dir / "reports" / f"{report.sweep_id}.json", report.to_dict())
    written = {}
    for node, found in sorted(findings_for(report, link_action).items()):
        if not valid_name(node):
            continue
        path = results_dir / "nodes" / f"{node}.json"
        _write_json(path, {"format": FORMAT, "node": node, "sweep_id": report.sweep_id,
                           "time": report.ended or report.started, "findings": [f.to_dict() for f in found]})
        written[node] = path
    return written
