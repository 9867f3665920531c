"""The remediation engine's queue: intents in the journal's order, each with its key and its attempts; retried after a
backoff that doubles up to retry_max_s while the scheduler cannot be reached (or asks to wait), superseded when a later
transition of the node back to healthy is queued behind it, and finished with its outcome journalled. A mixin of
Engine (agent/act/remediation.py)."""
from __future__ import annotations

from typing import Any, Sequence

from gpuwarden.agent.act.remediation_base import EngineState
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.backoff import doubling_delay
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs import respond as job_response
from gpuwarden.agent.jobs.respond import JOB_ACTION

log = logs.get_logger("gpuwarden.remediation")

# scheduler outage) when a later transition of the node back to healthy is queued is superseded, not carried out:
# a node that recovered in the meantime must not be cordoned, quarantined, swapped, reset or ticketed after the fact.
SUPERSEDABLE = ("cordon", "drain", "quarantine", "take_spare", "reset_gpu", "reboot", "ticket", "retire")



@dataclass
class _Item:
    key: str
    action: str
    detail: dict[str, Any]
    attempts: int = 0
    not_before: float = 0.0


def _transition(key: str) -> str:
    """The transition an intent's key belongs to (`<at>:<from>-><to>:<action>` less the action): the intents of one
    transition share it."""
    return key.rsplit(":", 1)[0]


class IntentQueue(EngineState):
    """The queue and the outcome of each intent."""

    # -- the queue (enqueue with the daemon's lock held) -----------------------------------------------------------
    def enqueue(self, intents: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
        with self.lock:
            for key, action, detail in intents:
                if key not in self._queued:
                    self._queued.add(key)
                    self._queue.append(_Item(key, action, dict(detail)))
            self.wanted.notify_all()

    def pending(self) -> list[tuple[str, str, dict[str, Any]]]:
        with self.lock:
            return [(i.key, i.action, i.detail) for i in (*self._queue, *self._deferred)]

    def ready(self, now: float) -> bool:
        """An intent can be tried now (call with the lock held): the worker must not sleep."""
        return bool(self._queue) and self._queue[0].not_before <= now and self._latch is None

    def _healthy_after(self, item: _Item) -> bool:
        """Whether `item` acts on a fault and a later transition of the node back to healthy is queued behind it
        (called with the lock held)."""
        if item.action not in SUPERSEDABLE or item.detail.get("to") in (None, "healthy"):
            return False
        mine = _transition(item.key)
        return any(later.detail.get("to") == "healthy" and _transition(later.key) != mine
                   and float(later.detail.get("at") or 0) >= float(item.detail.get("at") or 0)
                   for later in list(self._queue)[1:])

    def _retry(self, item: _Item, now: float, error: str, busy: bool = False) -> float:
        delay = doubling_delay(self.settings.retry_min_s, self.settings.retry_max_s, item.attempts)
        item.attempts += 1
        item.not_before = now + delay
        if busy:
            if self._waiting is None:
                self._waiting_since = now
            if self._waiting != error:
                log.warning("intent waits: the scheduler asks to come back later", action=item.action,
                            key=item.key, waiting_for=error, retry_in_s=delay, attempt=item.attempts)
            self._waiting, self._error, self._error_since = error, None, None
            self._save_status()
            return delay
        if self._error is None:
            self._error_since = now
        if self._error != error:
            log.error("intent not carried out yet; retrying", action=item.action, key=item.key, error=error,
                      retry_in_s=delay, attempt=item.attempts)
        self._error = error
        self._save_status()
        return delay

    def _scheduler_ok(self, now: float) -> None:
        if self._error is not None:
            log.warning("carrying out intents again", error_was=self._error, since=self._error_since)
        elif self._waiting is not None:
            log.info("the wait is over; carrying out intents again", waited_for=self._waiting,
                     since=self._waiting_since)
        if self._error is not None or self._waiting is not None:
            self._error = self._error_since = self._waiting = self._waiting_since = None
            self._save_status()

    def _finish(self, item: _Item, outcome: str) -> None:
        kind = outcome.split(":", 1)[0].split(" ", 1)[0]
        kind = {"dry-run": "dry_run", "done": "done", "refused": "refused", "failed": "failed",
                "already": "already", "superseded": "superseded"}.get(kind, "done")
        with self.lock:
            if self._queue and self._queue[0] is item:
                self._queue.popleft()
            self._queued.discard(item.key)
            self._counts[kind] += 1
            if item.action == JOB_ACTION:
                job_action = "dry_run" if kind == "dry_run" else job_response.action_taken(outcome)
                if job_action is not None:
                    self._count_job(item, job_action)
        if item.action == JOB_ACTION and self._job_progress.pop(item.key, None) is not None:
            self._save_status()
        log.info("intent carried out" if self.settings.acting else "would act", action=item.action, key=item.key,
                 outcome=outcome, reason=item.detail.get("reason", ""))
        self.hooks.done(item.key, self.clock(), outcome)
