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
- the scheduler: the local adapter (`agent/act/adapters/local.py`), its SQLite file in a temporary folder (in
  memory-backed /dev/shm where there is one). Every write goes to it. The fleet view (`nodes()`) is served from
  a copy of its rows, refreshed from the database after every write that touches a node (`mirror_matches()`
  checks the copy against the database); reading 10,000 rows for each breaker judgement would cost more than
  the rest of the simulation.

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
- the workload: a backlog of slices of S nodes, one per S nodes the policy keeps in service in each rack, each
  running until a node of it fails; an interrupted slice gives its nodes back and joins the queue (first come,
  first placed); a queued slice is placed on the rack with the fewest healthy free in-service nodes that still
  has S (best fit), and works after `restart_min` minutes (reloading its checkpoint). The scheduler places only
  on nodes whose hardware works (a job placed on a dead node fails at once: modelled as never placed). A
  slice's nodes run one job each at the scheduler (`set_jobs`);
- the jobs: each slice runs one distributed training job on all its nodes (`gpus_per_node` GPUs each), so a job is
  as large as the policy's slice: the slice is the unit the scheduler places, and a job smaller than a slice would
  outlive its slice's interruption, a larger one would need its slices placed together across racks (neither is
  modelled). The job checkpoints every `checkpoint_min` minutes from the moment it works. A failure that hits it
  while it works dooms its collectives: every rank blocks in the same collective, and the job holds all its GPUs
  (its slice cannot be placed again) until it ends. It loses the work since its last checkpoint ((failure time -
  the time it started working) mod the interval) and the time until it ends, each times its GPUs. A failure that
  hits a slice with no job working (restarting) ends that start-up at once and costs no job time.

How a doomed job ends (`job_response`):
- gpuwarden ends it (the default): each failed node of the job has its engine given the job intent, after its
  transition's own intents (the engine ends a job only where it took the node out first). The job ends `abort_s`
  after the requeue lands on the simulated clock: the fault's detection and the scheduler's calls, which take no
  simulated time here. The requeue lands at the failure, unless the breaker holds the node's intents (it waits
  with them) or it is refused; the job's watchdog still ends it `watchdog_min` after the failure if that comes
  first;
- `job_response=False`: no job intent; every doomed job ends when its watchdog fires.
A job that ends is requeued at the scheduler (its next run: by gpuwarden, or by the scheduler itself when the job's
processes exit), and its slice queued to be placed again.

Both responses in one run: the failures do not depend on the workload (each node's own stream), so a run charges
each interruption both ways: the work since the checkpoint (the same), and the idle until the job ends: the
watchdog timeout, against how long gpuwarden took in the run (`job_response=False`: `abort_s`, as if nothing
held it). Charging the watchdog leaves out what a restart later by the timeout would shift afterwards: the phase of
the job's checkpoints at its next failure, a failure that meets the job already hung. Those change the checkpoint
loss by chance, not on average; a run with `job_response=False`, where each slice waits for its watchdog, checks
the charge (tests/test_plan_simulate.py).

Randomness: every node's failures and repairs come from its own stream, seeded by (seed, node index), so two
policies (or responses to a doomed job) simulated with the same seed see the same failures at the same times (a
like-for-like comparison), and the same seed gives the same report.
"""
from __future__ import annotations

import contextlib
import heapq
import math
import os
import random
import shutil
import sqlite3
import tempfile
import threading
from collections import deque
from dataclasses import field
from pathlib import Path
from typing import Any, Iterator

from gpuwarden.agent.act.adapters.local import LocalAdapter, read_views
from gpuwarden.agent.act.intents import transition_intents
from gpuwarden.agent.act.remediation import RESET_AT_KEY, Engine, Hooks, Settings
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView, Service
from gpuwarden.agent.jobs.doom import intent_key
from gpuwarden.agent.jobs.respond import JOB_ACTION
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeRecord, NodeState, next_state, wants_retest

HOUR = 3600.0
DAY = 86400.0
CATEGORIES = ("working", "restarting", "hung", "idle", "spare", "out")  # where each node-hour went


@dataclass(frozen=True)
class Policy:
    spares: int  # spares per rack, held out of service in the rack's pool
    slice: int  # nodes per slice, placed within one rack

    @property
    def name(self) -> str:
        return f"spares={self.spares},slice={self.slice}"


@dataclass(frozen=True)
class Burst:
    rack: int  # rack index, from 0
    nodes: int  # nodes of the rack that fail at once, by name from the `first`
    at_h: float  # hours into the simulation
    first: int = 0  # the first of them, by its place in the rack (from 0)


@dataclass(frozen=True)
class SimConfig:
    racks: int = 128
    nodes_per_rack: int = 18
    days: float = 30.0
    mtbi_days: float = 490.0
    repair_median_h: float = 48.0
    repair_sigma: float = 0.8
    restart_min: float = 10.0
    observe_s: float = 60.0
    retest_s: float = 600.0
    breaker_reset_h: float = 2.0
    bursts: tuple[Burst, ...] = ()
    seed: int = 1
    sample_h: float = 1.0  # the capacity series: one point per this many hours
    gpus_per_node: int = 4  # a GB200 NVL72 compute tray
    # Young's optimum interval sqrt(2 x checkpoint stall x job MTBI) for a job on 16 nodes (MTBI 490 / 16 days) is an
    # hour for a stall of 2.4 s, longer for any costlier checkpoint: hourly is, if anything, frequent.
    checkpoint_min: float = 60.0
    watchdog_min: float = 10.0  # PyTorch's NCCL process-group timeout, its default since 2.2
    abort_s: float = 2.0  # the fault seen (one 1 s poll of the detecting check) and the scheduler's calls (1 s)
    job_response: bool = True  # gpuwarden ends a doomed job; False: it waits for its watchdog


@dataclass
class JobLosses:
    """GPU-hours the jobs lost to failures, under each response to a doomed job: the work since its last checkpoint
    (the same under both) and its GPUs idle until it ended."""
    response: str  # the run's own timeline: "fast-abort" (gpuwarden ends doomed jobs) or "watchdog"
    job_nodes: int
    gpus_per_node: int
    checkpoint_min: float
    watchdog_min: float
    abort_s: float
    interrupted: int = 0  # working jobs a failure doomed
    checkpoint_gpu_hours: float = 0.0
    idle_gpu_hours_watchdog: float = 0.0
    idle_gpu_hours_fast_abort: float = 0.0
    ended_by_gpuwarden: int = 0  # doomed jobs gpuwarden's requeue ended
    ended_by_watchdog: int = 0  # doomed jobs whose watchdog fired first (the breaker held the requeue, a refusal)

    @property
    def job_gpus(self) -> int:
        return self.job_nodes * self.gpus_per_node

    @property
    def gpu_hours_lost_watchdog(self) -> float:
        return self.checkpoint_gpu_hours + self.idle_gpu_hours_watchdog

    @property
    def gpu_hours_lost_fast_abort(self) -> float:
        return self.checkpoint_gpu_hours + self.idle_gpu_hours_fast_abort

    @property
    def gpu_hours_saved(self) -> float:
        return self.gpu_hours_lost_watchdog - self.gpu_hours_lost_fast_abort

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_hours_lost_watchdog": round(self.gpu_hours_lost_watchdog, 3),
                "gpu_hours_lost_fast_abort": round(self.gpu_hours_lost_fast_abort, 3),
                "gpu_hours_saved": round(self.gpu_hours_saved, 3), "interrupted": self.interrupted,
                "checkpoint_gpu_hours": round(self.checkpoint_gpu_hours, 3),
                "idle_gpu_hours_watchdog": round(self.idle_gpu_hours_watchdog, 3),
                "idle_gpu_hours_fast_abort": round(self.idle_gpu_hours_fast_abort, 3),
                "ended_by_gpuwarden": self.ended_by_gpuwarden, "ended_by_watchdog": self.ended_by_watchdog,
                "response": self.response,
                "settings": {"job_nodes": self.job_nodes, "gpus_per_node": self.gpus_per_node,
                             "job_gpus": self.job_gpus, "checkpoint_min": self.checkpoint_min,
                             "watchdog_min": self.watchdog_min, "abort_s": self.abort_s}}


@dataclass
class Report:
    policy: str
    nodes: int
    racks: int
    days: float
    seed: int
    slices: int  # the backlog: slices the policy plans for
    node_hours: dict[str, float]  # per category (CATEGORIES), summing to total_node_hours
    total_node_hours: float
    usable_node_hours: float  # node-hours in slices doing work
    failures: int
    repairs: int
    interruptions: int  # a running slice lost a node
    waits: int  # placements of a slice that had to wait for a rack
    wait_slice_hours: float  # total time slices were queued
    max_wait_h: float
    spares_consumed: int  # spares taken into service
    spares_for_spares: int  # of them, taken for a node that failed while it was itself a spare in the pool
    slice_must_move: int  # a quarantined node's rack had no spare left
    breaker_trips: int  # engines the breaker latched
    retired: int
    jobs: JobLosses
    series: list[tuple[float, int]] = field(default_factory=list)  # (hours, nodes working)

    @property
    def usable_share(self) -> float:
        return self.usable_node_hours / self.total_node_hours if self.total_node_hours else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "nodes": self.nodes, "racks": self.racks, "days": self.days,
                "seed": self.seed, "slices": self.slices, "total_node_hours": round(self.total_node_hours, 3),
                "usable_node_hours": round(self.usable_node_hours, 3), "usable_share": round(self.usable_share, 6),
                "node_hours": {k: round(v, 3) for k, v in self.node_hours.items()}, "failures": self.failures,
                "repairs": self.repairs, "interruptions": self.interruptions, "waits": self.waits,
                "wait_slice_hours": round(self.wait_slice_hours, 3), "max_wait_h": round(self.max_wait_h, 3),
                "spares_consumed": self.spares_consumed, "spares_for_spares": self.spares_for_spares,
                "slice_must_move": self.slice_must_move,
                "breaker_trips": self.breaker_trips, "retired": self.retired, "jobs": self.jobs.to_dict(),
                "series": [[round(t, 3), n] for t, n in self.series]}


@dataclass
class _Slice:
    id: int
    nodes: list[int] = field(default_factory=list)
    queued_since: float | None = 0.0  # None while placed
    working_from: float = 0.0
    run: int = 0  # its job's run at the scheduler (the restart count a requeue raises)
    doomed_at: float | None = None  # a failure doomed its job, which holds the slice until it ends
    abort_at: float | None = None  # when gpuwarden's requeue ends the doomed job
    requeued: bool = False  # this run was requeued by gpuwarden


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The engine and the adapter log every intent; a simulation of thousands of them would drown the report."""
    with logs.silenced("critical"):
        yield


def scratch_dir() -> Path:
    """Where the scheduler's SQLite file goes: memory-backed /dev/shm where there is one (a write costs a quarter
    of one on disk), else the temporary folder."""
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="gpuwarden-sim-", dir=base))


class _Scheduler:
    """The local adapter, every call passed through; the fleet view served from a copy of its rows that is read
    back from the database after each write that names a node."""

    def __init__(self, real: LocalAdapter, fleet: "Fleet"):
        self.real, self.fleet = real, fleet
        self.name, self.timeout_s = real.name, real.timeout_s
        self.views: dict[str, NodeView] = {}
        self._db: sqlite3.Connection | None = None

    def reread(self, *names: str) -> None:
        if self._db is None:
            self._db = sqlite3.connect(str(self.real.db), isolation_level=None)
        for view in read_views(self._db, names):
            old = self.views.get(view.name)
            self.views[view.name] = view
            if old != view:
                self.fleet.view_changed(view.name)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def nodes(self) -> list[NodeView]:
        return list(self.views.values())

    def node(self, node: str) -> NodeView:
        view = self.real.node(node)
        self.reread(node)
        return view

    def spares(self, domain: str) -> list[str]:
        return self.real.spares(domain)

    def _write(self, call: str, node: str, *args: Any) -> Any:
        result = getattr(self.real, call)(node, *args)
        self.reread(node)
        return result

    def cordon(self, node: str, reason: str) -> None:
        self._write("cordon", node, reason)

    def drain(self, node: str, reason: str) -> None:
        self._write("drain", node, reason)

    def quarantine(self, node: str, reason: str) -> None:
        self._write("quarantine", node, reason)

    def resume(self, node: str) -> None:
        self._write("resume", node)

    def publish_domain(self, node: str, domain: str) -> None:
        self._write("publish_domain", node, domain)

    def return_to_pool(self, node: str, domain: str) -> None:
        self._write("return_to_pool", node, domain)

    def set_jobs(self, node: str, jobs: int | None) -> None:
        self._write("set_jobs", node, jobs)

    # A job's calls name no node row: nothing to read back.
    def job(self, job: Any) -> Any:
        return self.real.job(job)

    def mark_job(self, job: Any, reason: str) -> None:
        self.real.mark_job(job, reason)

    def signal_job(self, job: Any, signal: str) -> None:
        self.real.signal_job(job, signal)

    def requeue_job(self, job: Any) -> None:
        self.real.requeue_job(job)

    def cancel_job(self, job: Any) -> None:
        self.real.cancel_job(job)

    def set_job(self, job: Any, state: str, requeueable: bool | None = None) -> None:
        self.real.set_job(job, state, requeueable)

    def take_spare(self, domain: str, for_node: str) -> str | None:
        spare = self.real.take_spare(domain, for_node)
        self.reread(for_node, *([spare] if spare else []))
        if spare is not None:
            self.fleet.spare_taken(spare, for_node)
        return spare

    def mirror_matches(self) -> bool:
        return {v.name: v for v in self.real.nodes()} == self.views


class _Recovery:
    """The recovery steps' outside world: a ticket is opened, a reset or reboot is accepted (the node's fault is
    a repair's, which the repair time models)."""

    @dataclass(frozen=True)
    class _Outcome:
        ok: bool
        detail: str

    def reset_gpus(self, *args: Any) -> Any:
        return self._Outcome(True, "simulated")

    def reboot(self, *args: Any) -> Any:
        return self._Outcome(True, "simulated")

    def open_ticket(self, *args: Any) -> Any:
        return self._Outcome(True, "simulated ticket")


class Fleet:
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
        self.slices: list[_Slice] = []
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
        self.scheduler = _Scheduler(real, self)
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
        self.slices = [_Slice(j) for j in range(c.racks * per_rack)]
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
            return self._report()
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
            # A ticket command is configured so that the ladder's last step reaches the recovery steps (_Recovery).
            settings = Settings(mode="act", adapter="local", node_name=name, publish_every_s=0.0,
                                spares=dict(self.settings.spares), ticket_command=("simulated-ticket",))
            engine = self.engines[i] = Engine(self.scheduler, settings, hooks, domain=self.domain_of(i),
                                              clock=self.clock, lock=self._lock, recovery=_Recovery())
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

    # -- the workload ----------------------------------------------------------------------------------------------
    def _category(self, i: int) -> str:
        j = self.slice_of[i]
        if j >= 0:
            sl = self.slices[j]
            if sl.doomed_at is not None:
                return "hung" if self.hw_ok[i] else "out"
            return "working" if sl.working_from <= self.now else "restarting"
        view = self.scheduler.views.get(self.names[i])
        if view is None or not self.hw_ok[i]:
            return "out"
        if view.spare:
            return "spare"
        if view.service is Service.IN_SERVICE:
            return "idle"
        return "out"

    def _refresh(self, i: int) -> None:
        cat = self._category(i)
        old = self.cat[i]
        if cat != old:
            if old:
                self.count[old] -= 1
            self.count[cat] += 1
            self.cat[i] = cat
        rack = i // self.config.nodes_per_rack
        if cat == "idle":
            self.free[rack].add(i)
        else:
            self.free[rack].discard(i)

    def _job_ref(self, j: int) -> JobRef:
        # Slurm's kind of job: a requeue starts its next run (the restart count), which the local scheduler keeps.
        return JobRef("slurm", str(j + 1), self.slices[j].run, "simulated")

    def _job_gpus(self, sl: _Slice) -> int:
        return len(sl.nodes) * self.config.gpus_per_node

    def _doom(self, j: int) -> bool:
        """A node of slice `j` failed: its working job is doomed and holds the slice until it ends (True while it
        does); a job still restarting ends at once, at no job time."""
        sl = self.slices[j]
        if sl.doomed_at is not None:
            return True  # already hung: this failure costs it nothing more
        self.interruptions += 1
        if sl.working_from > self.now:
            self._end_job(j)
            return False
        gpus = self._job_gpus(sl)
        self.jobs.interrupted += 1
        self._job_gpu_s["checkpoint"] += ((self.now - sl.working_from) % (self.config.checkpoint_min * 60.0)) * gpus
        self._job_gpu_s["watchdog"] += self.watchdog_s * gpus
        if not self.config.job_response:
            self._job_gpu_s["fast_abort"] += min(self.config.abort_s, self.watchdog_s) * gpus
        sl.doomed_at = self.now
        self._push(self.now + self.watchdog_s, "watchdog", j)
        for i in sl.nodes:
            self._refresh(i)
        return True

    def _end_job(self, j: int) -> None:
        sl = self.slices[j]
        if sl.doomed_at is not None and self.config.job_response:
            self._job_gpu_s["fast_abort"] += (self.now - sl.doomed_at) * self._job_gpus(sl)
        if not sl.requeued:
            # The job's processes exited (its watchdog, or its start-up failed) and the scheduler requeued it: the
            # local scheduler's requeue is what starts a job's next run, whoever asks.
            self.scheduler.requeue_job(self._job_ref(j))
        sl.run += 1
        sl.doomed_at = sl.abort_at = None
        sl.requeued = False
        self._release(j)

    def _release(self, j: int) -> None:
        sl = self.slices[j]
        nodes, sl.nodes = sl.nodes, []
        sl.queued_since = self.now
        for i in nodes:
            self.slice_of[i] = -1
            self.scheduler.set_jobs(self.names[i], 0)
            self._refresh(i)
        self.queue.append(j)  # first come, first placed: every queued slice is one that lost a node

    def _place(self, restart: bool = True) -> None:
        size = self.policy.slice
        while self.queue:
            fits = [(len(f), r) for r, f in enumerate(self.free) if len(f) >= size]
            if not fits:
                return
            _, rack = min(fits)
            j = self.queue.popleft()
            sl = self.slices[j]
            waited = self.now - (sl.queued_since or 0.0)
            if restart and waited > 0:
                self.waits += 1
                self.wait_s += waited
                self.max_wait_s = max(self.max_wait_s, waited)
            sl.queued_since = None
            sl.working_from = self.now + (self.config.restart_min * 60.0 if restart else 0.0)
            sl.nodes = sorted(self.free[rack])[:size]
            self.scheduler.set_job(self._job_ref(j), "running", requeueable=True)
            for i in sl.nodes:
                self.slice_of[i] = j
                self.scheduler.set_jobs(self.names[i], 1)
                self._refresh(i)
            if sl.working_from > self.now:
                self._push(sl.working_from, "working", j)

    def _on_working(self, j: int) -> None:
        sl = self.slices[j]
        if sl.working_from == self.now:
            for i in sl.nodes:
                self._refresh(i)

    # -- the report ----------------------------------------------------------------------------------------------
    def _report(self) -> Report:
        c = self.config
        waited_now = sum(self.now - s.queued_since for s in self.slices if s.queued_since is not None)
        longest = max([self.max_wait_s] + [self.now - s.queued_since for s in self.slices
                                           if s.queued_since is not None])
        retired = sum(1 for r in self.records.values() if r.state is NodeState.RETIRED)
        gpu_s = dict(self._job_gpu_s)
        if c.job_response:
            # A job still hung at the end is charged in full, as the watchdog column charges it.
            for sl in self.slices:
                if sl.doomed_at is not None:
                    end = min(sl.abort_at if sl.abort_at is not None else math.inf, sl.doomed_at + self.watchdog_s)
                    gpu_s["fast_abort"] += (end - sl.doomed_at) * self._job_gpus(sl)
        jobs = self.jobs
        jobs.checkpoint_gpu_hours, jobs.idle_gpu_hours_watchdog, jobs.idle_gpu_hours_fast_abort = (
            gpu_s["checkpoint"] / HOUR, gpu_s["watchdog"] / HOUR, gpu_s["fast_abort"] / HOUR)
        return Report(self.policy.name, self.n, c.racks, c.days, c.seed, len(self.slices),
                      {k: v / HOUR for k, v in self.hours.items()}, self.n * self.horizon / HOUR,
                      self.hours["working"] / HOUR, self.failures, self.repairs, self.interruptions, self.waits,
                      (self.wait_s + waited_now) / HOUR, longest / HOUR, self.spares_consumed,
                      self.spares_for_spares, self.must_move,
                      self.trips, retired, jobs, self.series)


def simulate(config: SimConfig, policy: Policy, workdir: Path | None = None) -> Report:
    """One policy over the configured fleet and days; the same config and seed give the same report."""
    return Fleet(config, policy, workdir).run()
