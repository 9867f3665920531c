"""The remediation engine's circuit breaker gate: before a cordon, drain or quarantine of a node in service, the fleet
is read from the scheduler and agent/act/breaker.py judges it; a refusal latches until `gpuwarden breaker reset`, and
a drain that landed is judged again (undone when the breaker then holds). A mixin of Engine
(agent/act/remediation.py)."""
from __future__ import annotations

from typing import Any, Callable

from gpuwarden.agent.act.breaker import BreakerPolicy
from gpuwarden.agent.act.breaker import judge as breaker_judge
from gpuwarden.agent.act.remediation_base import EngineState
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import SchedulerAdapter, Service

log = logs.get_logger("gpuwarden.remediation")

RESET_AT_KEY = "breaker_reset_at"  # meta key `gpuwarden breaker reset` writes, the engine reads


class _Latched(Exception):
    """The breaker is open: the intent waits for a reset."""


class BreakerGate(EngineState):
    """The gate, its latch and its reset."""

    # -- the circuit breaker -----------------------------------------------------------------------------------
    def _gate(self, adapter: SchedulerAdapter, now: float) -> None:
        self._still_latched()
        judge, policy = self._breaker()
        me = self.settings.node_name
        # Judged as one more on top of the others' drains, never ranked by its own start among them (a stale mark
        # of ours on a node back in service must not make it "already drained"): as the judgement after the cordon.
        verdict = judge([v for v in adapter.nodes() if v.name != me], me, self.domain, now, policy, self._reset_at)
        if verdict.allow:
            return
        self._trip(verdict, now)
        raise _Latched()

    def _still_latched(self) -> None:
        """Raises _Latched while the breaker holds; closes it when the operator reset it since it opened."""
        reset = self.hooks.read_meta(RESET_AT_KEY)
        if isinstance(reset, (int, float)) and (self._reset_at is None or reset > self._reset_at):
            self._reset_at = float(reset)
        if self._latch is not None and self._reset_at is not None \
                and self._reset_at >= float(self._latch.get("since") or 0.0):
            # Reset after the latch (while running, or while the agent was down): judged again from here on.
            log.warning("circuit breaker reset by the operator; judging the fleet again", was=self._latch.get("reason"))
            self._latch = None
            self._save_status()
        if self._latch is not None:
            raise _Latched()

    def _confirm(self, adapter: SchedulerAdapter, now: float) -> None:
        """After taking a node out of service: agents on nodes that failed at the same moment each judged a fleet
        without the others' drains. So the fleet is read again, now with theirs, and this node judged as if it
        were still in service; past the limit, its drain (ours) is undone and the breaker latches. An agent that
        keeps its drain has seen every drain kept before its own, so no more than the limit are ever kept (when
        several raced, all of them may let go: the brake errs on the side of the fleet)."""
        me = self.settings.node_name
        judge, policy = self._breaker()
        verdict = judge([v for v in adapter.nodes() if v.name != me], me, self.domain, now, policy, self._reset_at)
        if verdict.allow:
            return
        self._trip(verdict, now, undo=True)
        self._undo(adapter)
        raise _Latched()

    def _held(self, adapter: SchedulerAdapter, view: Any) -> None:
        """The breaker holds (unless reset): a drain it refused after the fact is undone if that did not happen
        yet, and the intent waits."""
        if self._latch is not None and self._latch.get("undo") and view.ours and not view.quarantined \
                and not view.spare and view.service is not Service.IN_SERVICE:
            self._undo(adapter)
        self._still_latched()

    def _undo(self, adapter: SchedulerAdapter) -> None:
        adapter.resume(self.settings.node_name)  # our own drain: back in service
        log.warning("drain undone: the circuit breaker holds", node=self.settings.node_name)
        if self._latch is not None:
            self._latch = {**self._latch, "undo": False}
            self._save_status()

    def _trip(self, verdict: Any, now: float, undo: bool = False) -> None:
        self._latch = {"open": True, "since": now, "reason": verdict.reason, "cluster": list(verdict.cluster),
                       "domain": list(verdict.domain) if verdict.domain is not None else None, "undo": undo}
        log.error("circuit breaker open: cordons held until `gpuwarden breaker reset`", reason=verdict.reason,
                  cluster=verdict.cluster, domain=verdict.domain)
        self._save_status()

    def _breaker(self) -> tuple[Callable[..., Any], Any]:
        if self._judge is not None:
            return self._judge, dict(self.settings.breaker)
        return breaker_judge, BreakerPolicy(**self.settings.breaker)

    @property
    def breaker_open(self) -> bool:
        return self._latch is not None
