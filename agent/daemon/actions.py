"""The daemon's action worker (a mixin of agent.daemon.loop.Daemon): the remediation engine (agent/act/remediation.py)
run outside the lock, so that a scheduler that hangs delays actions, never detection; the job response's doom
rules (agent/jobs/guard.py) that add a job's intents to a transition's; the hooks the engine calls back.
"""
from __future__ import annotations

from typing import Any

from gpuwarden.agent.act import recovery as recovery_steps
from gpuwarden.agent.act.intents import Intent, fault_gpus, transition_intents
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.backoff import Backoff
from gpuwarden.agent.core.config import JOBS_DEFAULTS
from gpuwarden.agent.core.job import jobs_in
from gpuwarden.agent.state.store_errors import StoreError
from gpuwarden.agent.state.transitions import NodeState, Transition

log = logs.get_logger("gpuwarden.daemon")
JOBS_CHECK = "jobs"  # the check that knows which job uses what (checks/jobs.py): the doom rules read its state


class ActionWorker:
    """Needs from the daemon: node, config, opt, engine, store, stop_event, _lock, _records, _record, _done, _held,
    _holders_at, _jobs_read, _guard, _actions_wanted, _write_wanted, _commit(), _active(), _set_meta(), _publish(),
    _beat(), _beat_off() and _fail_loop()."""

    def _jobs_doomed(self, now: float) -> tuple[bool, list[Intent]]:
        """Whether a fault dooms a job on the node now, and the intents of the jobs it newly dooms (lock held)."""
        rec = self._records.get(JOBS_CHECK)
        if rec is None or not rec.state.get("jobs"):
            return False, []
        if self._jobs_read[0] is not rec.state:  # read again only when the jobs check judged anew (every 10 s)
            self._jobs_read = (rec.state, jobs_in(rec.state))
        settings = getattr(self.config, "jobs", None) or JOBS_DEFAULTS
        return self._guard.observe(self._active(), self._jobs_read[1], settings, self.node.info.boot_id, now)

    def _intents(self, t: Transition) -> list[Intent]:
        return transition_intents(t, self._active(), self.opt.domain, self.engine.settings.swap,
                                  self.node.info.boot_id)

    def _intent_done(self, key: str, at: float, outcome: str) -> None:
        with self._lock:
            self._done.append((key, at, outcome))
            self._write_wanted.set()
            self._publish()

    def _set_meta_locked(self, key: str, value: Any) -> None:
        with self._lock:
            self._set_meta(key, value)
            self._publish()

    def _read_meta(self, key: str) -> Any:
        """A meta value as the store holds it now: what another process (`gpuwarden breaker reset`) wrote."""
        try:
            return self.store.meta(key)
        except StoreError as exc:
            log.warning("could not read the state store", key=key, error=str(exc))
            return None

    def _fault_clear(self) -> bool:
        with self._lock:
            return self._record.clear_since is not None

    def _action_loop(self) -> None:
        backoff = Backoff(self.opt.error_backoff_s, self.opt.retry_max_s)
        while not self.stop_event.is_set():
            # Waiting on the scheduler is waiting on something outside the agent: a restart would not help, so a
            # call that hangs does not starve the watchdog (actions_pending and scheduler_reachable show it).
            self._beat_off("actions")
            try:
                self._refresh_holders()
                wait = self.engine.step()
                backoff.succeeded()
            except Exception as exc:  # noqa: BLE001 - a bug in the engine must not end the worker
                self._fail_loop("actions", None, exc)
                wait = backoff.failed()
            if wait <= 0:
                continue
            wait = min(wait, self.opt.store_check_s)
            self._beat("actions", wait)
            with self._lock:
                if self.stop_event.is_set() or self.engine.ready(self.opt.clock()):
                    continue
                self._actions_wanted.wait(wait)
        self._beat_off("actions")

    def _refresh_holders(self) -> None:
        """Whether a process still holds a GPU of a quarantined node's fault: a GPU reset waits until none does
        (agent/state/transitions.py). Read only while the ladder has yet to take its first step."""
        with self._lock:
            rec, gpus = self._record, fault_gpus(self._active())
        now = self.opt.clock()
        if rec.state is not NodeState.QUARANTINED or rec.step or now < self._holders_at:
            return
        self._holders_at = now + self.opt.holders_every_s
        held: bool | None = None
        try:
            recovery = self.opt.recovery
            if recovery is None:
                recovery = recovery_steps
            held = any(recovery.gpu_holders(self.node, gpus).values()) if gpus else None
        except Exception as exc:  # noqa: BLE001 - could not look: not known, never "free"
            log.warning("could not read the processes holding the GPUs", gpus=gpus, error=str(exc))
        with self._lock:
            if held != self._held:
                self._held = held
                self._commit([], None, self.opt.clock())
