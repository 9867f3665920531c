"""The fleet simulator's workload: slices placed on racks, the training job each runs, and what a failure costs it.

The workload: a backlog of slices of S nodes, one per S nodes the policy keeps in service in each rack, each
running until a node of it fails; an interrupted slice gives its nodes back and joins the queue (first come,
first placed); a queued slice is placed on the rack with the fewest healthy free in-service nodes that still
has S (best fit), and works after `restart_min` minutes (reloading its checkpoint). The scheduler places only
on nodes whose hardware works (a job placed on a dead node fails at once: modelled as never placed). A
slice's nodes run one job each at the scheduler (`set_jobs`).

The jobs: each slice runs one distributed training job on all its nodes (`gpus_per_node` GPUs each), so a job is
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
"""
from __future__ import annotations

from collections import deque
from dataclasses import field
from typing import TYPE_CHECKING

from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import Service

if TYPE_CHECKING:
    from gpuwarden.agent.fleet.plan.sim_config import Policy, SimConfig
    from gpuwarden.agent.fleet.plan.sim_report import JobLosses
    from gpuwarden.agent.fleet.plan.sim_scheduler import MirroredScheduler


@dataclass
class Slice:
    id: int
    nodes: list[int] = field(default_factory=list)
    queued_since: float | None = 0.0  # None while placed
    working_from: float = 0.0
    run: int = 0  # its job's run at the scheduler (the restart count a requeue raises)
    doomed_at: float | None = None  # a failure doomed its job, which holds the slice until it ends
    abort_at: float | None = None  # when gpuwarden's requeue ends the doomed job
    requeued: bool = False  # this run was requeued by gpuwarden


class Workload:
    """The workload's half of a run (sim_fleet.py's Fleet): which slice each node works for, the queue of slices
    waiting for a rack, and the node-hours per category. Its state lives on the Fleet, which sets it up."""

    config: SimConfig
    policy: Policy
    now: float
    names: list[str]
    hw_ok: list[bool]
    scheduler: MirroredScheduler
    slice_of: list[int]
    cat: list[str]
    count: dict[str, int]
    free: list[set[int]]
    slices: list[Slice]
    queue: deque[int]
    jobs: JobLosses
    watchdog_s: float
    _job_gpu_s: dict[str, float]
    interruptions: int
    waits: int
    wait_s: float
    max_wait_s: float

    def _push(self, t: float, kind: str, i: int) -> None:
        raise NotImplementedError  # the Fleet's event queue

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

    def _job_gpus(self, sl: Slice) -> int:
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

