"""The remediation engine's job intents (agent/jobs/respond.py): a doomed job ended only where its node's quarantine
passed the breaker, a signalled job's requeue deferred out of the queue, and the job metrics (what was done, how fast,
the GPU-seconds it is estimated to have saved). A mixin of Engine (agent/act/remediation.py)."""
from __future__ import annotations

from gpuwarden.agent.act.remediation_base import EngineState
from gpuwarden.agent.act.remediation_breaker import BreakerGate
from gpuwarden.agent.act.remediation_queue import _Item
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import Refused, SchedulerAdapter, Service
from gpuwarden.agent.jobs import respond as job_response

log = logs.get_logger("gpuwarden.remediation")


class JobIntents(BreakerGate, EngineState):
    """Job intents and their metrics."""

    def _defer(self, item: _Item, exc: job_response.Deferred) -> None:
        with self.lock:
            if self._queue and self._queue[0] is item:
                self._queue.popleft()
            item.not_before, item.attempts = exc.until, 0
            self._deferred.append(item)
            if item.key not in self._job_progress:  # its first action, the signal: what the time to act measures
                self._count_job(item, "signal", ended=False)
            self._job_progress[item.key] = exc.progress
        log.info("job signalled; its requeue waits", key=item.key, until=exc.until)
        self._save_status()

    def _undefer(self, now: float) -> None:
        """Deferred job intents whose time has come go back to the head of the queue (lock held)."""
        due = [d for d in self._deferred if d.not_before <= now]
        for d in reversed(due):
            self._deferred.remove(d)
            self._queue.appendleft(d)

    def _job(self, adapter: SchedulerAdapter, item: _Item, now: float) -> str:
        """A doomed job (agent/jobs/respond.py), only where the node's own quarantine passed the circuit breaker: while
        the breaker holds, the job waits with the node's intents; a node the scheduler still has in service (its
        quarantine superseded, never carried out) could take a requeued job straight back, and ends no job."""
        self._still_latched()
        if not self._out_of_service:
            view = adapter.node(self.settings.node_name)
            self._spare = view.spare
            if view.service is Service.IN_SERVICE:
                raise Refused(f"{self.settings.node_name} is in service at the scheduler: a job is ended only where "
                              "its node was taken out first (a requeued job would land back on it)")
        return job_response.carry_out(adapter, item.detail, self.settings.node_name, now,
                                      self._job_progress.get(item.key))

    def _count_job(self, item: _Item, action: str, ended: bool = True) -> None:
        """The job metrics of a job intent that took `action` (one of job_response.JOB_ACTION_KINDS; lock held), when
        it ended or (`ended` False) when it signalled its job first and waits for the requeue: what was done, how long
        after the fault (of the first action: a requeue that waited out signal_before_s after its signal took its time
        at the signal), and the GPU-seconds it is estimated to have saved ((the job's watchdog timeout - the time to
        the end of the job) x its GPUs)."""
        d = item.detail
        rule = str(d.get("rule") or "")
        signalled = item.key in self._job_progress  # counted at its signal: a job that then ended is no second one
        if not (ended and signalled and action == "signal"):
            self._job_counts[(action, rule)] = self._job_counts.get((action, rule), 0) + 1
        fault_at = d.get("fault_at")
        if action == "dry_run" or not isinstance(fault_at, (int, float)):
            return
        took = max(0.0, self.clock() - float(fault_at))
        if not signalled:  # no signal before this action (the progress is kept from the signal)
            self._job_latency[action] = took
        if not ended:
            return  # the job goes on until its requeue: what it saved is counted then
        watchdog, gpus = d.get("watchdog_s"), d.get("gpus_total")
        if action != "notify" and isinstance(watchdog, (int, float)) and isinstance(gpus, (int, float)):
            self._job_saved[action] = self._job_saved.get(action, 0.0) + max(0.0, float(watchdog) - took) * float(gpus)
