"""What a multi-node sweep's parts hand each other: the outcome of one group's collective, and what a launcher
returns for one group. The launchers (agent/fleet/sweep/launch*.py), the criteria (agent/fleet/sweep/criteria.py), the
localisation (agent/fleet/sweep/localise.py) and the orchestrator (agent/fleet/sweep/sweep.py) share these and nothing
else."""
from __future__ import annotations

import enum

from gpuwarden.agent.core.records import dataclass


class Outcome(enum.Enum):
    """One group's collective, judged."""
    PASS = "pass"
    SLOW = "slow"  # below its baseline: p95 latency of small messages, or bus bandwidth of large ones
    WRONG = "wrong"  # wrong values (#wrong > 0, out-of-bounds values): silent data corruption somewhere in it
    FAILED = "failed"  # crashed, exited non-zero, truncated output, an NCCL error
    HUNG = "hung"  # ran past its time limit; the job was ended
    PREEMPTED = "preempted"  # the scheduler took the nodes back (preemption, a cancel): no verdict
    NOT_RUN = "not_run"  # could not start (no allocation in time, the nodes busy, the launcher failed): no verdict

    @property
    def bad(self) -> bool:
        """The group holds a fault (a bad node, or both ends of a bad link)."""
        return self in (Outcome.SLOW, Outcome.WRONG, Outcome.FAILED, Outcome.HUNG)

    @property
    def decided(self) -> bool:
        """The run says something about its nodes: a preempted or unstarted one says nothing, either way."""
        return self not in (Outcome.PREEMPTED, Outcome.NOT_RUN)


# How a launcher's run of one group ended.
EXITED = "exited"  # the launcher returned by itself (any exit status)
TIMEOUT = "timeout"  # past its time limit: the job was cancelled and the launcher ended
PREEMPTED = "preempted"  # the scheduler ended it to give the nodes to other work (or someone cancelled it)
NOT_STARTED = "not-started"  # no allocation within the start timeout
LAUNCH_ERROR = "launch-error"  # the launcher could not be run or refused the request
ENDINGS = (EXITED, TIMEOUT, PREEMPTED, NOT_STARTED, LAUNCH_ERROR)


@dataclass(frozen=True)
class GroupRun:
    """One group's collective as the launcher saw it."""
    nodes: tuple[str, ...]
    output: str  # the launcher's stdout (rank-labelled lines, as srun -l or mpirun --tag-output print them)
    stderr: str  # the last 64 KiB of its stderr
    returncode: int | None  # None: it was ended by the sweep (timeout) or never started
    ended: str  # one of ENDINGS
    duration_s: float
    job_id: str | None = None
    detail: str = ""  # why, for any ending but EXITED
