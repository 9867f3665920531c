"""The fleet simulator's inputs: the placement policy, a rack-level burst of failures and the simulation's settings
(agent/fleet/plan/sim_fleet.py runs them)."""
from __future__ import annotations

from gpuwarden.agent.core.records import dataclass

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

