"""What a fleet simulation reports: node-hours per category, interruptions, waits, spares, breaker trips, and the
GPU-hours the slices' jobs lost under each response to a doomed job; `build_report` reads them off a finished run."""
from __future__ import annotations

import math
from dataclasses import field
from typing import TYPE_CHECKING, Any

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.fleet.plan.sim_config import HOUR
from gpuwarden.agent.state.transitions import NodeState

if TYPE_CHECKING:
    from gpuwarden.agent.fleet.plan.sim_fleet import Fleet


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


def build_report(fleet: Fleet) -> Report:
    """The report of a run that reached its horizon (or its last event)."""
    c = fleet.config
    waited_now = sum(fleet.now - s.queued_since for s in fleet.slices if s.queued_since is not None)
    longest = max([fleet.max_wait_s] + [fleet.now - s.queued_since for s in fleet.slices
                                       if s.queued_since is not None])
    retired = sum(1 for r in fleet.records.values() if r.state is NodeState.RETIRED)
    gpu_s = dict(fleet._job_gpu_s)
    if c.job_response:
        # A job still hung at the end is charged in full, as the watchdog column charges it.
        for sl in fleet.slices:
            if sl.doomed_at is not None:
                end = min(sl.abort_at if sl.abort_at is not None else math.inf, sl.doomed_at + fleet.watchdog_s)
                gpu_s["fast_abort"] += (end - sl.doomed_at) * fleet._job_gpus(sl)
    jobs = fleet.jobs
    jobs.checkpoint_gpu_hours, jobs.idle_gpu_hours_watchdog, jobs.idle_gpu_hours_fast_abort = (
        gpu_s["checkpoint"] / HOUR, gpu_s["watchdog"] / HOUR, gpu_s["fast_abort"] / HOUR)
    return Report(fleet.policy.name, fleet.n, c.racks, c.days, c.seed, len(fleet.slices),
                  {k: v / HOUR for k, v in fleet.hours.items()}, fleet.n * fleet.horizon / HOUR,
                  fleet.hours["working"] / HOUR, fleet.failures, fleet.repairs, fleet.interruptions, fleet.waits,
                  (fleet.wait_s + waited_now) / HOUR, longest / HOUR, fleet.spares_consumed,
                  fleet.spares_for_spares, fleet.must_move,
                  fleet.trips, retired, jobs, fleet.series)
