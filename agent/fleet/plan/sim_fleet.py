"""A seeded discrete-event simulation of a rack-scale fleet under gpuwarden's remediation: how many node-hours do
slices get to work, how often is a running slice interrupted, how long do slices wait for a rack, how many
spares are consumed, how often the circuit breaker trips, and the GPU-hours the slices' training jobs lose to
failures when a doomed job waits for its NCCL watchdog and when gpuwarden ends it at once, for one placement policy
(spares per rack, slice size) over simulated days.

What is the real code, driven on a simulated clock (the LocalAdapter's `clock=`, the engine's `clock=`):
- the node state machine: `agent/state/transitions.py` `next_state` and `wants_retest` decide every transition of a node
  that fails (HEALTHY -> CORDONED -> QUARANTINED, the recovery ladder's ticket, the retest, back to HEALTHY);
- the daemon's turn of a transition into intents (`agent/act/intents.py` `transition_intents`: the cordon, drain,
  ticket, resume, and the take_spare a quarantine in a known NVLink domain adds), given the node's active
  findings, its domain and the swap setting;
- the remediation engine (`agent/act/remediation.py` `Engine`, mode "act"), one per node that ever fails, made when
  it first fails: it carries the intents out, asks the circuit breaker (`agent/act/breaker.py`) before taking a node
  out of service, plans and takes spares (`agent/act/spares.py` `plan_swap`, `wants_back_in_pool`), and latches
  when the breaker refuses;
- the job response: the engine's "job" intent (policy requeue), carried out by `agent/jobs/respond.py`
  `carry_out` against the local scheduler's jobs table: the job is read, reconciled, marked and requeued, once per
  run however many of its nodes ask;
- the scheduler: the local adapter (`agent/act/adapters/local.py`), every write to its SQLite file, behind a mirror
  of its node rows that serves the fleet view (agent/fleet/plan/sim_scheduler.py).

What is modelled (the world outside the agent):
- node failures: each node fails after an exponential time with mean `mtbi_days`, drawn again after each repair;
  a failure is one FAIL finding whose action is SERVICE (the node needs a repair: the ladder opens a ticket);
  optional bursts fail many nodes of one rack at once (a rack-level event);
- repairs: a lognormal time with median `repair_median_h` and shape `repair_sigma` (0: every repair takes the
  median), from the failure; the retest after a repair passes;
- the daemon's observations: at the failure, every `observe_s` while the node's state has a timer running,
  at the repair, and a retest `retest_s` after the state machine asks for one;
- the operator: resets the breaker `breaker_reset_h` after it trips (0: never, the cordons it held wait to the
  end);
- the workload (slices placed on racks), their training jobs and how a doomed job ends: agent/fleet/plan/
  sim_workload.py.

Randomness: every node's failures and repairs come from its own stream, seeded by (seed, node index), so two
policies (or responses to a doomed job) simulated with the same seed see the same failures at the same times (a
like-for-like comparison), and the same seed gives the same report.
"""
from __future__ import annotations

import contextlib
import heapq
import math
import random
import shutil
import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.intents import transition_intents
from gpuwarden.agent.act.remediation import Engine, Hooks, Settings
from gpuwarden.agent.act.remediation_breaker import RESET_AT_KEY
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.fleet.plan.sim_config import CATEGORIES, DAY, HOUR, Policy, SimConfig
from gpuwarden.agent.fleet.plan.sim_report import JobLosses, Report, build_report
from gpuwarden.agent.fleet.plan.sim_scheduler import MirroredScheduler, SimRecovery, scratch_dir
from gpuwarden.agent.fleet.plan.sim_workload import Slice, Workload
from gpuwarden.agent.jobs.doom import intent_key
from gpuwarden.agent.jobs.respond import JOB_ACTION
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeRecord, NodeState, next_state, wants_retest


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The engine and the adapter log every intent; a simulation of thousands of them would drown the report."""
    with logs.silenced("critical"):
        yield



class Fleet(Workload):
    """One simulation run. `run()` returns the Report; `transitions` and `intents` keep what the real code did."""

    def __init__(self, config: SimConfig, policy: Policy, workdir: Path | None = None):
        c = self.config = config
        self.policy = policy
        self.now = 0.0
        self.horizon = c.days * DAY
        self.n = c.racks * c.nodes_per_rack
        self.names = [f"r{r:04d}n{k:03d}" for r in range(c.racks) for k in range(c.nodes_per_rack)]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.hw_ok = [True] * self.n
        self.records: dict[int, NodeRecord] = {}
        self.engines: dict[int, Engine] = {}
        self.slice_of = [-1] * self.n
        self.cat = [""] * self.n
        self.count = dict.fromkeys(CATEGORIES, 0)
        self.hours = dict.fromkeys(CATEGORIES, 0.0)
        self.free: list[set[int]] = [set() for _ in range(c.racks)]
        self.slices: list[Slice] = []
        self.queue: deque[int] = deque()
        self.events: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self._pending_observe: dict[int, float] = {}
        self._pending_retest: set[int] = set()
        self._latched: set[int] = set()
        self._reset_due: float | None = None
        self._meta: dict[str, Any] = {}
        self._rngs: dict[int, random.Random] = {}
        self._lock = threading.RLock()
        self.transitions: list[tuple[str, Any]] = []  # (node, Transition), in order
        self.intents: list[tuple[str, str, str, float]] = []  # (node, key, outcome, at) as the engines ended them
        self.failures = self.repairs = self.interruptions = self.waits = 0
        self.wait_s = self.max_wait_s = 0.0
        self.spares_consumed = self.spares_for_spares = self.must_move = self.trips = 0
        self._failed_as_spare: set[int] = set()
        self.watchdog_s = c.watchdog_min * 60.0
        self.jobs = JobLosses("fast-abort" if c.job_response else "watchdog", policy.slice, c.gpus_per_node,
                              c.checkpoint_min, c.watchdog_min, c.abort_s)
        self._job_gpu_s = {"checkpoint": 0.0, "watchdog": 0.0, "fast_abort": 0.0}  # summed in GPU-seconds
        self._job_intents: dict[str, tuple[int, int]] = {}  # a job intent's key -> (slice, run) it dooms
        self.series: list[tuple[float, int]] = []
        self._next_sample = 0.0
        self._dir = workdir or scratch_dir()
        self._own_dir = workdir is None
        real = LocalAdapter(self._dir / "actions.jsonl", db=self._dir / "scheduler.db", clock=self.clock)
        self.scheduler = MirroredScheduler(real, self)
        self.settings = Settings(mode="act", adapter="local", publish_every_s=0.0,
                                 spares={"per_domain": policy.spares})

    # -- what the real code calls back ---------------------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def domain_of(self, i: int) -> str:
        return f"rack{i // self.config.nodes_per_rack:04d}"

    def findings(self, i: int) -> list[Finding]:
        if self.hw_ok[i]:
            return []
        name = self.names[i]
        return [Finding("node_failure", "node-failure", Entity.node(name), Status.FAIL,
                        f"{name}: hardware failure (simulated), needs a repair", Action.SERVICE)]

    def view_changed(self, name: str) -> None:
        self._refresh(self.index[name])

    def spare_taken(self, spare: str, for_node: str) -> None:
        self.spares_consumed += 1
        if self.index[for_node] in self._failed_as_spare:
            self.spares_for_spares += 1

    # -- setup -------------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        c, p = self.config, self.policy
        s = self.scheduler
        for i, name in enumerate(self.names):
            s.publish_domain(name, self.domain_of(i))
        for r in range(c.racks):
            for k in range(c.nodes_per_rack - p.spares, c.nodes_per_rack):
                i = r * c.nodes_per_rack + k
                s.return_to_pool(self.names[i], self.domain_of(i))
        per_rack = (c.nodes_per_rack - p.spares) // p.slice
        self.slices = [Slice(j) for j in range(c.racks * per_rack)]
        self.queue.extend(range(len(self.slices)))
        self._place(restart=False)
        rng = random.Random(f"{c.seed}:first")
        mean = c.mtbi_days * DAY
        for i in range(self.n):
            t = rng.expovariate(1.0 / mean)
            if t < self.horizon:
                self._push(t, "fail", i)
        for k, b in enumerate(c.bursts):
            self._push(b.at_h * HOUR, "burst", k)
        self._push(self.horizon, "end", -1)

    # -- the event loop ----------------------------------------------------------------------------------------
    def run(self) -> Report:
        try:
            with quiet_logs():
                self._setup()
                while self.events:
                    t, _, kind, i = heapq.heappop(self.events)
                    self._advance(t)
                    if kind == "end":
                        break
                    getattr(self, f"_on_{kind}")(i)
                    self._place()
            return build_report(self)
        finally:
            self.scheduler.close()
            if self._own_dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def _push(self, t: float, kind: str, i: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, i))

    def _advance(self, t: float) -> None:
        t = min(t, self.horizon)
        while self._next_sample <= t and self._next_sample <= self.horizon:
            self.series.append((self._next_sample / HOUR, self.count["working"]))
            self._next_sample += self.config.sample_h * HOUR
        dt = t - self.now
        if dt > 0:
            for k, v in self.count.items():
                self.hours[k] += v * dt
            self.now = t

    def _rng(self, i: int) -> random.Random:
        rng = self._rngs.get(i)
        if rng is None:
            rng = self._rngs[i] = random.Random(f"{self.config.seed}:node:{i}")
        return rng

    # -- events --------------------------------------------------------------------------------------------------
    def _on_fail(self, i: int) -> None:
        if not self.hw_ok[i]:
            return  # already failed (a burst took it first): one repair covers both
        self.failures += 1
        self.hw_ok[i] = False
        view = self.scheduler.views.get(self.names[i])
        if view is not None and view.spare:
            self._failed_as_spare.add(i)
        c = self.config
        repair = c.repair_median_h * HOUR * (math.exp(self._rng(i).gauss(0.0, c.repair_sigma))
                                             if c.repair_sigma > 0 else 1.0)
        self._push(self.now + repair, "repair", i)
        j = self.slice_of[i]
        hung = j >= 0 and self._doom(j)
        self._refresh(i)
        self._observe(i)
        if hung and self.config.job_response:
            self._job_intent(i, j)

    def _on_burst(self, k: int) -> None:
        b = self.config.bursts[k]
        base = b.rack * self.config.nodes_per_rack
        for i in range(base + b.first, base + min(b.first + b.nodes, self.config.nodes_per_rack)):
            self._on_fail(i)

    def _on_repair(self, i: int) -> None:
        self.repairs += 1
        self.hw_ok[i] = True
        self._failed_as_spare.discard(i)
        self._refresh(i)
        self._observe(i)
        t = self.now + self._rng(i).expovariate(1.0 / (self.config.mtbi_days * DAY))
        if t < self.horizon:
            self._push(t, "fail", i)

    def _on_watchdog(self, j: int) -> None:
        sl = self.slices[j]
        if sl.doomed_at is not None and sl.doomed_at + self.watchdog_s == self.now:
            self.jobs.ended_by_watchdog += 1
            self._end_job(j)

    def _on_aborted(self, j: int) -> None:
        sl = self.slices[j]
        if sl.doomed_at is not None and sl.abort_at == self.now:
            self.jobs.ended_by_gpuwarden += 1
            self._end_job(j)

    def _on_observe(self, i: int) -> None:
        if self._pending_observe.get(i) == self.now:
            del self._pending_observe[i]
            self._observe(i)

    def _on_retest(self, i: int) -> None:
        self._pending_retest.discard(i)
        self._observe(i, retest=self.hw_ok[i])

    def _on_engine(self, i: int) -> None:
        self._drive(i)

    def _on_reset(self, _: int) -> None:
        """The operator looked at what tripped the breaker and reset it (`gpuwarden breaker reset`)."""
        self._reset_due = None
        self._meta[RESET_AT_KEY] = self.now
        for i in sorted(self._latched):
            self._latched.discard(i)
            self._drive(i)

    # -- the agent on one node -------------------------------------------------------------------------------------
    def _engine(self, i: int) -> Engine:
        engine = self.engines.get(i)
        if engine is None:
            name = self.names[i]
            hooks = Hooks(done=lambda key, at, outcome, name=name: self._intent_done(name, key, outcome, at),
                          set_meta=lambda key, value: None,
                          fault_clear=lambda i=i: self.records[i].clear_since is not None,
                          read_meta=self._meta.get)
            # A ticket command is configured so that the ladder's last step reaches the recovery steps (SimRecovery).
            settings = Settings(mode="act", adapter="local", node_name=name, publish_every_s=0.0,
                                spares=dict(self.settings.spares), ticket_command=("simulated-ticket",))
            engine = self.engines[i] = Engine(self.scheduler, settings, hooks, domain=self.domain_of(i),
                                              clock=self.clock, lock=self._lock, recovery=SimRecovery())
        return engine

    def _observe(self, i: int, retest: bool | None = None) -> None:
        engine = self._engine(i)
        rec = self.records.get(i, NodeRecord())
        new, transition = next_state(rec, self.findings(i), (), self.now, DEFAULT_POLICY, retest, None)
        self.records[i] = new
        if transition is not None:
            name = self.names[i]
            self.transitions.append((name, transition))
            engine.enqueue(transition_intents(transition, self.findings(i), self.domain_of(i), engine.settings.swap,
                                              "simulated"))
            self._drive(i)
        if wants_retest(new, self.now, DEFAULT_POLICY):
            if i not in self._pending_retest:
                self._pending_retest.add(i)
                self._push(self.now + self.config.retest_s, "retest", i)
        elif not self._at_rest(i, new):
            t = self.now + self.config.observe_s
            if self._pending_observe.get(i) != t:
                self._pending_observe[i] = t
                self._push(t, "observe", i)

    def _at_rest(self, i: int, rec: NodeRecord) -> bool:
        """Nothing the state machine waits for on a timer: only an outside event (a failure, a repair) moves it."""
        if rec.state is NodeState.RETIRED:
            return True
        if rec.state is NodeState.HEALTHY:
            return self.hw_ok[i]
        if rec.state is NodeState.QUARANTINED and not self.hw_ok[i]:
            return rec.step == "ticket"
        return False

    def _drive(self, i: int) -> None:
        """Carries the engine's queue out now, as far as it goes; a backoff comes back as an event, a latch waits
        for the operator's reset."""
        engine = self.engines[i]
        was_open = engine.breaker_open
        for _ in range(64):  # bounded: each turn ends one intent or waits
            if not engine.pending():
                break
            wait = engine.step()
            if engine.breaker_open:
                if not was_open:
                    self.trips += 1
                self._latched.add(i)
                if self._reset_due is None and self.config.breaker_reset_h > 0:
                    self._reset_due = self.now + self.config.breaker_reset_h * HOUR
                    self._push(self._reset_due, "reset", -1)
                return
            if wait > 0:
                self._push(self.now + wait, "engine", i)
                return
        if engine.pending():
            self._push(self.now, "engine", i)

    def _intent_done(self, name: str, key: str, outcome: str, at: float) -> None:
        self.intents.append((name, key, outcome, at))
        if key.endswith(":take_spare") and "must move" in outcome:
            self.must_move += 1
        job = self._job_intents.pop(key, None)
        if job is not None and outcome.startswith("done: requeued"):
            j, run = job
            sl = self.slices[j]
            if sl.run == run and sl.doomed_at is not None and sl.abort_at is None:
                sl.requeued = True
                sl.abort_at = at + self.config.abort_s
                self._push(sl.abort_at, "aborted", j)

    def _job_intent(self, i: int, j: int) -> None:
        """The intent the daemon queues for a job its node's fault doomed (agent/jobs/doom.py's key), after the
        transition's own intents: the engine ends a job only where it took the node out first."""
        sl, name = self.slices[j], self.names[i]
        ref = self._job_ref(j)
        incident = f"node-failure:{name}:{self.now:.6f}"
        key = intent_key(ref, incident)
        detail = {"at": self.now, "job": ref.to_dict(), "incident": incident, "rule": "node-failure",
                  "reason": f"node_failure node-failure {name} (simulated)",
                  "finding": self.findings(i)[0].to_dict(), "fault_at": self.now, "policy": "requeue",
                  "signal": "USR1", "signal_before_s": 0.0, "node": name, "gpus_total": self._job_gpus(sl),
                  "watchdog_s": self.watchdog_s}
        self._job_intents[key] = (j, sl.run)
        self._engine(i).enqueue([(key, JOB_ACTION, detail)])
        self._drive(i)


def simulate(config: SimConfig, policy: Policy, workdir: Path | None = None) -> Report:
    """One policy over the configured fleet and days; the same config and seed give the same report."""
    return Fleet(config, policy, workdir).run()
