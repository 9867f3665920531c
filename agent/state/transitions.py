"""The node state machine, as a pure function of the previous record, the findings that hold now, and time.

HEALTHY → SUSPECT → CORDONED → QUARANTINED → (retest) → HEALTHY, or RETIRED after too many failed retests.
Edge-triggered: actions (cordon, drain, resume, retire, uncordon, and the recovery steps) are emitted only on a
transition. UNKNOWN is an input of its own: a check that cannot look makes the node SUSPECT after a grace period,
never CORDONED: a bad signal must not drain a node (let alone a fleet).

While QUARANTINED and the fault holds, the recovery ladder takes one step at a time, each only when the one before
did not clear the fault within its settle time: a GPU reset (only for a fault whose worst action is RESET_GPU, and
only once no process holds the GPU), then a reboot, then a service ticket; then it waits for the repair. A fault
that clears is judged by the retest, which returns the node to service or, after max_retests failures, retires it.
"""
from __future__ import annotations

import enum
from dataclasses import replace
from itertools import compress, repeat
from operator import attrgetter, is_
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.model import Action, Finding, Status
from gpuwarden.agent.core.records import dataclass


class NodeState(enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    CORDONED = "cordoned"
    QUARANTINED = "quarantined"
    RETIRED = "retired"


@dataclass(frozen=True)
class NodeRecord:
    state: NodeState = NodeState.HEALTHY
    since: float = 0.0  # when the node entered `state`
    reason: str = ""
    retests: int = 0  # failed retests since the node was quarantined
    fault_since: float | None = None  # first time the current fault (or could-not-look) was seen
    clear_since: float | None = None  # first time everything looked fine again
    step: str = ""  # QUARANTINED: the last recovery step taken ("" none yet; one of RECOVERY_STEPS)
    step_since: float | None = None  # when it was taken

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "since": self.since, "reason": self.reason, "retests": self.retests,
                "fault_since": self.fault_since, "clear_since": self.clear_since, "step": self.step,
                "step_since": self.step_since}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NodeRecord":
        step = str(d.get("step") or "")
        if step and step not in RECOVERY_STEPS:
            raise ValueError(f"unknown recovery step {step!r}")
        step_since = d.get("step_since")
        return cls(NodeState(d["state"]), float(d["since"]), d.get("reason", ""), int(d.get("retests", 0)),
                   d.get("fault_since"), d.get("clear_since"), step,
                   float(step_since) if step_since is not None else None)


@dataclass(frozen=True)
class Transition:
    frm: NodeState
    to: NodeState
    reason: str
    actions: tuple[str, ...]
    at: float


RECOVERY_STEPS = ("reset_gpu", "reboot", "ticket")  # the ladder, in order; each is also the intent's action

DEFAULT_POLICY: dict[str, Any] = {
    "unknown_grace_s": 120.0,  # a check that cannot look for this long makes the node SUSPECT
    "suspect_clear_s": 600.0,  # SUSPECT back to HEALTHY after this long with nothing to say
    "cordon_clear_s": 300.0,  # CORDONED back to HEALTHY if the fault is gone this long before quarantine
    "quarantine_after_s": 300.0,  # a DRAIN-class fault that persists this long in CORDONED quarantines
    "retest_after_s": 60.0,  # QUARANTINED: all clear this long -> run a retest
    "max_retests": 2,  # failed retests before the node is RETIRED
    # The recovery ladder ([remediation.ladder]).
    "reset_gpu": True,  # try a GPU reset for a RESET_GPU-class fault
    "reboot": True,  # try a reboot (after the reset, or first for a REBOOT- or DRAIN-class fault)
    "step_after_s": 60.0,  # the first step waits this long after quarantine: the drain and the work's exit go first
    "holders_wait_s": 300.0,  # a reset waits this long after quarantine for the GPU's processes to go, then skips
    "reset_settle_s": 300.0,  # after a reset, the fault has this long to clear before the next step
    "reboot_settle_s": 1800.0,  # after a reboot, the same
}


def _worst(findings: list[Finding]) -> tuple[Status, Action, str]:
    """The worst finding's status, action and name (the first of equals). A node can hold many findings (an incident
    per GPU and XID) and this runs at every observation: the statuses are read and compared by identity, and the
    worst picked, at C speed (an enum member's hash is a Python-level call)."""
    statuses = list(map(_STATUS, findings))
    for status in (Status.FAIL, Status.WARN):  # the concerns, worst first
        if status in statuses:
            worst = max(compress(findings, map(is_, statuses, repeat(status))), key=_ACTION)  # the first of equals
            return worst.status, worst.action, f"{worst.check}/{worst.code} on {worst.entity.label()}"
    return Status.OK, Action.NONE, ""


_STATUS = attrgetter("status")
_ACTION = attrgetter("action")


def next_state(rec: NodeRecord, findings: Iterable[Finding], unknown: Iterable[str], now: float,
               policy: Mapping[str, Any] = DEFAULT_POLICY, retest: bool | None = None, held: bool | None = None,
               doomed: bool = False) -> tuple[NodeRecord, Transition | None]:
    """The record after this observation, and the transition it caused (None when the state stays).

    One observation moves the state as far as the rules allow (to a fixpoint): a RESET_GPU-class fault on a
    healthy node cordons and quarantines it at once, as one transition whose actions are every step's, in order.

    `findings`: the active findings of every check; `unknown`: the checks that could not look; `retest`: the
    outcome of a retest that finished since the last call (None when none did); `held`: whether a process holds
    a GPU of the fault (None: not known), which a GPU reset needs to be False; `doomed`: a fault has doomed a job
    running on the node (agent/jobs/doom.py): a DRAIN-class fault then quarantines at once, as a RESET_GPU-class
    one does, so the job can be ended with its node out of service (a requeued job must not land back on it)."""
    findings, unknown = list(findings), sorted(unknown)
    worst = _worst(findings)  # the same at every step of the walk
    # The ladder's first step comes at an observation after the one that quarantined: the drain goes first.
    recover = rec.state is NodeState.QUARANTINED
    first: Transition | None = None
    actions: list[str] = []
    for _ in range(len(NodeState)):  # each step moves forward on the ladder: a bounded walk
        rec, step = _step(rec, worst, unknown, now, policy, retest, held if recover else _NO_LADDER, doomed)
        if step is None:
            break
        retest = None  # a retest's outcome is used by the step it moves, once
        first = first or step
        actions += step.actions
        if step.to is first.frm:
            break
    if first is None:
        return rec, None
    last_to = rec.state
    return rec, Transition(first.frm, last_to, rec.reason, tuple(actions), now)


_NO_LADDER: Any = object()


def _step(rec: NodeRecord, worst: tuple[Status, Action, str], unknown: list[str], now: float,
          policy: Mapping[str, Any], retest: bool | None, held: Any, doomed: bool = False
          ) -> tuple[NodeRecord, Transition | None]:
    status, action, why = worst
    fault = status is Status.FAIL and action >= Action.DRAIN
    concern = status in (Status.FAIL, Status.WARN) or bool(unknown)
    rec = replace(rec, fault_since=(rec.fault_since if rec.fault_since is not None else now) if concern else None,
                  clear_since=None if concern else (rec.clear_since if rec.clear_since is not None else now))

    def go(to: NodeState, reason: str, *actions: str, **changes: Any) -> tuple[NodeRecord, Transition]:
        new = replace(rec, state=to, since=now, reason=reason, **changes)
        return new, Transition(rec.state, to, reason, tuple(actions), now)

    s = rec.state
    if s is NodeState.RETIRED:
        return rec, None
    if s in (NodeState.HEALTHY, NodeState.SUSPECT):
        if fault:
            return go(NodeState.CORDONED, why, "cordon")
        if s is NodeState.HEALTHY and status in (Status.FAIL, Status.WARN):
            return go(NodeState.SUSPECT, why)
        concern_for = now - rec.fault_since if rec.fault_since is not None else 0.0
        if s is NodeState.HEALTHY and unknown and concern_for >= policy["unknown_grace_s"]:
            return go(NodeState.SUSPECT, f"could not look: {', '.join(unknown)}")
        cleared_for = now - rec.clear_since if rec.clear_since is not None else -1.0
        if s is NodeState.SUSPECT and cleared_for >= policy["suspect_clear_s"]:
            return go(NodeState.HEALTHY, "clear")
        return rec, None
    if s is NodeState.CORDONED:
        if fault and (action >= Action.RESET_GPU or doomed or now - rec.since >= policy["quarantine_after_s"]):
            return go(NodeState.QUARANTINED, why, "drain", step="", step_since=None)
        if rec.clear_since is not None and now - rec.clear_since >= policy["cordon_clear_s"]:
            return go(NodeState.HEALTHY, "fault cleared before quarantine", "uncordon")
        return rec, None
    # QUARANTINED: the recovery ladder while the fault holds; once it clears, a retest decides.
    if retest is True:
        return go(NodeState.HEALTHY, "retest passed", "resume", retests=0, step="", step_since=None)
    if retest is False:
        if rec.retests + 1 >= policy["max_retests"]:
            return go(NodeState.RETIRED, f"{rec.retests + 1} failed retests", "retire", retests=rec.retests + 1)
        return replace(rec, retests=rec.retests + 1, clear_since=None), None
    if fault and held is not _NO_LADDER:
        step = next_recovery(rec, action, now, policy, held)
        if step is not None:
            new = replace(rec, step=step, step_since=now)
            return new, Transition(rec.state, rec.state, f"recovery: {step} ({why})", (step,), now)
    return rec, None


def next_recovery(rec: NodeRecord, action: Action, now: float, policy: Mapping[str, Any] = DEFAULT_POLICY,
                  held: bool | None = None) -> str | None:
    """The recovery step to take now on a quarantined node whose fault (worst action `action`) still holds, or
    None (the step before is still settling, the reset waits for the GPU's processes, or the ladder is at its
    end: a ticket was opened and the node waits for the repair)."""
    # The steps this fault may use: a GPU reset only helps a fault that asks for one (REBOOT and SERVICE faults are
    # past what a reset fixes); a reboot helps anything up to REBOOT; a ticket is always the last step.
    ladder = [s for s, wanted in (("reset_gpu", action == Action.RESET_GPU and policy["reset_gpu"]),
                                  ("reboot", action <= Action.REBOOT and policy["reboot"]),
                                  ("ticket", True)) if wanted]
    if rec.step in ladder:
        after = ladder[ladder.index(rec.step) + 1:]
        settle = {"reset_gpu": policy["reset_settle_s"], "reboot": policy["reboot_settle_s"]}.get(rec.step)
        since = rec.step_since if rec.step_since is not None else rec.since
        if settle is None or not after or now - since < settle:
            return None
        return after[0]
    if now - rec.since < policy["step_after_s"]:
        return None
    if rec.step:  # a step this fault would not take (the fault changed): go on from the steps after it
        after = [s for s in ladder if RECOVERY_STEPS.index(s) > RECOVERY_STEPS.index(rec.step)]
        return after[0] if after else None
    if ladder[0] == "reset_gpu":
        if held is False:
            return "reset_gpu"
        if now - rec.since < policy["holders_wait_s"]:
            return None  # the drain lets the work finish: its processes leave the GPU
        return ladder[1]  # still held (or not known) after the wait: a reset would be refused; reboot instead
    return ladder[0]


def wants_retest(rec: NodeRecord, now: float, policy: Mapping[str, Any] = DEFAULT_POLICY) -> bool:
    """QUARANTINED and everything has looked fine for retest_after_s: time to run a retest."""
    return (rec.state is NodeState.QUARANTINED and rec.clear_since is not None
            and now - rec.clear_since >= policy["retest_after_s"])
