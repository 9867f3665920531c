"""What every scheduler adapter (local, Slurm, Kubernetes) offers the remediation engine, and the errors it raises.

The engine (agent/act/remediation.py) decides; an adapter only carries a decision to the scheduler and reads the
scheduler's view back. The contract:
- **Idempotent.** Every call may be repeated after a crash or a timeout: cordoning a cordoned node, draining a
  drained one, resuming a node that is already in service are no-ops that succeed.
- **Bounded.** Every call that reaches the scheduler has a timeout (`timeout_s`, given at construction); a call
  that runs out raises `Transient`.
- **Typed errors.** `Transient`: the scheduler could not be reached or asked to come back later (timeout,
  connection refused, slurmctld down, HTTP 429/5xx, a PodDisruptionBudget that forbids an eviction now): the
  engine retries with a backoff. `Busy`, a kind of `Transient`, says the scheduler was reached and answered "not
  yet" (a PodDisruptionBudget holding an eviction, pods still terminating): retried the same way, but the
  scheduler counts as reachable. `Refused`: the scheduler answered and said no (unknown node, a reason that is
  not ours, a spare taken by another agent): retrying the same call will not help.
- **Ours only.** The agent marks what it does (Slurm: a reason that starts with `REASON_PREFIX`; Kubernetes: a
  taint and a condition it owns). `resume` undoes only what carries that mark: an administrator's drain, or one
  by another health checker (NHC), is never undone (`Refused`).
- **The scheduler is the fleet's memory.** `nodes()` returns every node with what the agents published (its
  NVLink domain, whether it is a spare, when our drain began), so agents on many nodes reach the same view
  (circuit breaker, spare pool) without a coordinator of ours.
"""
from __future__ import annotations

import enum
from typing import Any, Protocol, Sequence

from gpuwarden.agent.core.records import dataclass

REASON_PREFIX = "gpuwarden:"  # every drain/cordon reason the agent writes starts with this
SPARE_REASON = "gpuwarden: spare"  # a spare held out of service (Slurm: drained with this reason)


class AdapterError(Exception):
    """A scheduler call did not do what was asked."""


class Transient(AdapterError):
    """Could not reach the scheduler, or it asked to come back later: retry with a backoff."""


class Busy(Transient):
    """The scheduler was reached and asked to come back later (a PodDisruptionBudget forbids an eviction now, pods
    are still terminating, work still runs): retry with a backoff; the scheduler itself is fine."""


class Refused(AdapterError):
    """The scheduler answered no: the same call will not succeed by retrying it."""


class Service(enum.Enum):
    """Where a node stands for new work, as the scheduler says."""
    IN_SERVICE = "in_service"  # takes new work
    CORDONED = "cordoned"  # no new work; running work goes on (Slurm DRAINING/DRAIN with jobs, k8s unschedulable)
    DRAINED = "drained"  # no new work and no work left
    DOWN = "down"  # the scheduler cannot reach the node (slurmd not answering, k8s NotReady)
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class NodeView:
    """One node as the scheduler sees it."""
    name: str
    service: Service
    reason: str | None = None  # the drain/cordon reason (Slurm Reason=, k8s our condition's message)
    reason_since: float | None = None  # when that reason was set (epoch seconds), when the scheduler says
    ours: bool = False  # the reason or taint is the agent's (resume is allowed)
    quarantined: bool = False  # drained by the agent and held for recovery
    domain: str | None = None  # NVLink domain the node's agent published (None: not published)
    spare: bool = False  # held out of service in its domain's spare pool
    jobs: int | None = None  # work running on the node (None: not known)


JOB_STATES = ("running", "pending", "suspended", "ending", "ended", "unknown")


@dataclass(frozen=True)
class JobView:
    """One job as the scheduler sees it, for the job response (agent/jobs/respond.py)."""
    id: str  # Slurm: the job id; Kubernetes: "namespace/name" of the pod
    state: str  # one of JOB_STATES: running | pending (requeued, waiting) | suspended | ending | ended | unknown
    nodes: tuple[str, ...] = ()  # where it runs now (empty: nowhere, or not said)
    run: int | None = None  # Slurm: its restart count; None where the scheduler has none (a pod is one run)
    requeueable: bool | None = None  # Slurm: Requeue=1; None: not said
    mark: str | None = None  # the reason gpuwarden last wrote on it (Slurm AdminComment, the pod's condition)


class SchedulerAdapter(Protocol):
    """The calls the remediation engine makes. `node` is the scheduler's name for the node."""
    name: str  # "local", "slurm", "kubernetes"
    timeout_s: float

    def nodes(self) -> Sequence[NodeView]:
        """Every node the scheduler knows, with the agent's published marks."""

    def node(self, node: str) -> NodeView:
        """One node; `Refused` when the scheduler does not know it."""

    def cordon(self, node: str, reason: str) -> None:
        """No new work on `node`; running work goes on. `reason` starts with REASON_PREFIX."""

    def drain(self, node: str, reason: str) -> None:
        """No new work, and the running work is let finish (Slurm) or evicted politely (Kubernetes, honouring
        PodDisruptionBudgets: `Transient` while a budget forbids it)."""

    def quarantine(self, node: str, reason: str) -> None:
        """Drained and marked as held for recovery (never taken as a spare, never resumed by another agent)."""

    def resume(self, node: str) -> None:
        """Back in service, only when the node's cordon/drain is ours (`Refused` otherwise); a node already in
        service is a no-op."""

    def publish_domain(self, node: str, domain: str) -> None:
        """Makes `node`'s NVLink domain part of the scheduler's view (Slurm node feature, k8s label), so every
        agent can group the fleet by domain. Repeated calls re-assert it (Slurm forgets scontrol-set features
        when slurmctld restarts)."""

    def spares(self, domain: str) -> list[str]:
        """The spare nodes of `domain`, held out of service and healthy."""

    def take_spare(self, domain: str, for_node: str) -> str | None:
        """Takes one spare of `domain` into service in place of `for_node`, atomically at the scheduler: two
        agents asking at once never get the same spare. Returns the spare's name, None when the pool is empty.
        Repeated for the same `for_node` (a retried intent), it returns the spare already taken for it."""

    def return_to_pool(self, node: str, domain: str) -> None:
        """Holds a repaired `node` out of service as a spare of `domain`."""

    # -- jobs (agent/jobs/respond.py): `job` is the agent's JobRef (scheduler, id, run) --------------------------------
    def job(self, job: Any) -> JobView | None:
        """The job as the scheduler has it now; None when it does not know it (ended and forgotten)."""

    def mark_job(self, job: Any, reason: str) -> None:
        """Puts `reason` (REASON_PREFIX first) where the job's owner and the administrator see it."""

    def signal_job(self, job: Any, signal: str) -> None:
        """Sends `signal` (a name: USR1) to every process of the job, so it can checkpoint and exit."""

    def requeue_job(self, job: Any) -> bool:
        """Ends the job's run and puts it back in the queue (`Refused` when it cannot be requeued). False: it was
        pending already (requeued by another node's agent, or by the job itself), nothing done."""

    def cancel_job(self, job: Any) -> None:
        """Ends the job."""
