"""The remediation engine's NVLink domain: a spare taken in place of this node (only one the agent took out itself),
this node returned to the spare pool when it is back, and the domain re-asserted at the scheduler every
publish_every_s. A mixin of Engine (agent/act/remediation.py)."""
from __future__ import annotations

from typing import Any, Mapping

from gpuwarden.agent.act.remediation_base import EngineState
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import SchedulerAdapter

log = logs.get_logger("gpuwarden.remediation")


class SpareSwap(EngineState):
    """Spares and the domain's publication."""

    # -- spares ----------------------------------------------------------------------------------------------------
    def _spare_policy(self) -> Any:
        return self._spares.SparePolicy(**{k: v for k, v in self.settings.spares.items() if k != "swap"})

    def _take_spare(self, adapter: SchedulerAdapter, detail: Mapping[str, Any], transition: str = "") -> str:
        """The scheduler is the arbiter (take_spare is atomic there); the plan (agent/act/spares.py) says beforehand
        whether the domain has a spare at all, and which domains could host the slice if not.

        A spare replaces only a node the agent itself took out of service: when this node's quarantine was refused
        (an administrator's drain, another health checker's) or undone since, the scheduler does not show it
        quarantined, and no spare is taken. The scheduler's view decides, not the journal's, so a restart between
        the quarantine and the swap reaches the same answer."""
        me, domain = self.settings.node_name, str(detail.get("domain") or "")
        if transition and transition == self._spare_quarantined:
            log.info("no spare taken: this node was itself a spare, held in the pool", node=me, domain=domain)
            return f"done: no spare taken: {me} was a spare of {domain} held in the pool (no slice ran on it)"
        fleet = list(adapter.nodes())
        mine = next((v for v in reversed(fleet) if v.name == me), None) or adapter.node(me)
        if not mine.quarantined:
            held = f"held by someone else: {mine.reason}" if mine.reason and not mine.ours else mine.service.value
            log.warning("no spare taken: this node is not quarantined by the agent", node=me, state=held)
            return f"refused: no spare taken: {me} is not quarantined by gpuwarden ({held}); the agent did not " \
                   "take it out of service, so it takes no spare in its place"
        plan = self._spares.plan_swap(fleet, me, self._spare_policy())
        spare = None if plan.slice_must_move else adapter.take_spare(domain, me)
        reason = plan.reason
        if spare is None:
            hosts = list(plan.hosts)
            self._swap = {"domain": domain, "spare": None, "slice_must_move": True, "hosts": hosts,
                          "reason": reason, "at": self.clock()}
            log.error("no spare left in the NVLink domain: the slice must move", domain=domain, hosts=hosts,
                      reason=reason)
            self._save_status()
            return f"done: no spare in {domain}; the slice must move (domains that could host it: " \
                   f"{', '.join(hosts) or 'none known'})"
        self._swap = {"domain": domain, "spare": spare, "slice_must_move": False, "hosts": [], "reason": reason,
                      "at": self.clock()}
        log.info("spare taken into service", domain=domain, spare=spare, for_node=me)
        self._save_status()
        return f"done: spare {spare} of {domain} taken into service"

    def _back_in_service(self, adapter: SchedulerAdapter) -> str:
        me = self.settings.node_name
        self._out_of_service = False
        if self.domain and self.settings.swap:
            if self._spares.wants_back_in_pool(list(adapter.nodes()), me, self._spare_policy()):
                adapter.return_to_pool(me, self.domain)
                self._spare = True
                return f"done: returned to the spare pool of {self.domain}"
        adapter.resume(me)
        self._spare = False
        return "done"

    @property
    def slice_must_move(self) -> bool:
        return bool(self._swap and self._swap.get("slice_must_move"))

    # -- the NVLink domain, re-asserted --------------------------------------------------------------------------
    def _publish_turn(self, now: float) -> float:
        """Re-asserts the node's domain at the scheduler every publish_every_s (Slurm forgets features set by
        scontrol when slurmctld restarts). Idempotent and not journalled: a failure is retried next period."""
        if not (self.settings.acting and self.domain and self.adapter is not None and self.settings.publish_every_s):
            return float("inf")
        if now < self._next_publish:
            return self._next_publish - now
        try:
            self.adapter.publish_domain(self.settings.node_name, self.domain)
            # Another node's agent may have taken this spare into service since: the fleet view follows.
            self._spare = self.adapter.node(self.settings.node_name).spare
            self._next_publish = now + self.settings.publish_every_s
        except Exception as exc:  # noqa: BLE001 - logged, tried again
            log.warning("could not re-assert the NVLink domain", domain=self.domain, error=str(exc))
            self._next_publish = now + min(self.settings.retry_max_s, self.settings.publish_every_s)
        return self._next_publish - now
