"""The daemon's job response: at every observation, the doom rules over the node's findings and the jobs its `jobs`
check knows (checks/jobs.py), and for each job a fault newly dooms, one intent keyed by (job run, incident).

Called by the daemon with its lock held, so it never waits on anything; it only decides. The engine carries the
intents out (agent/jobs/respond.py), after the node's own cordon and quarantine: the daemon puts them there in its
queue, and a doom makes the node's state machine quarantine at once (agent/state/transitions.py `doomed`).

A (job run, incident) is acted on once: the keys already in the journal are known at start, and each new one is
remembered; a restart finds the same key again and the journal's INSERT OR IGNORE keeps one. Several nodes of one job
that see one fabric fault each make their own intent: the scheduler's view of the job is the arbiter there (the
first requeue is seen by the others, which leave the job alone)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.job import JobOnNode
from gpuwarden.agent.core.model import Finding
from gpuwarden.agent.jobs import doom
from gpuwarden.agent.jobs.respond import JOB_ACTION

log = logs.get_logger("gpuwarden.jobs")
KEEP_KEYS = 10_000  # intent keys remembered (a key falls out only long after its job ended)
KEEP_INCIDENTS = 4096


class JobGuard:
    def __init__(self, node_name: str, domain_spans_nodes: bool, journal_keys: Iterable[str] = ()):
        self.node_name = node_name
        self.domain_spans_nodes = domain_spans_nodes
        self._made: OrderedDict[str, None] = OrderedDict((k, None) for k in journal_keys if k.startswith("job:"))
        self._first_seen: OrderedDict[str, float] = OrderedDict()  # incident -> when the guard first saw it

    def observe(self, findings: Sequence[Finding], jobs: Sequence[JobOnNode], settings: Mapping[str, Any],
                boot_id: str | None, now: float) -> tuple[bool, list[tuple[str, str, dict[str, Any]]]]:
        """(whether a fault dooms a job on the node now, the intents of the dooms not acted on before)."""
        if not jobs:
            return False, []
        dooms = doom.decide(findings, jobs, now, boot_id, self.domain_spans_nodes, self._first_seen)
        intents = []
        for d in dooms:
            self._first_seen.setdefault(d.incident, d.fault_at)
            if d.key in self._made:
                continue
            self._made[d.key] = None
            intents.append((d.key, JOB_ACTION, self._detail(d, settings, now)))
            log.warning("job doomed", job=d.job.job.key, rule=d.rule, reason=d.reason, policy=settings["on_doomed"],
                        gpus=list(d.job.gpu_indices), ranks=list(d.job.ranks))
        while len(self._made) > KEEP_KEYS:
            self._made.popitem(last=False)
        while len(self._first_seen) > KEEP_INCIDENTS:
            self._first_seen.popitem(last=False)
        return bool(dooms), intents

    def _detail(self, d: doom.Doom, settings: Mapping[str, Any], now: float) -> dict[str, Any]:
        job = d.job
        return {
            "at": now, "job": job.job.to_dict(), "incident": d.incident, "rule": d.rule, "reason": d.reason,
            "finding": d.finding.to_dict(), "fault_at": d.fault_at, "policy": settings["on_doomed"],
            "signal": settings["signal"], "signal_before_s": settings["signal_before_s"], "node": self.node_name,
            "gpus": list(job.gpu_indices), "ranks": list(job.ranks), "pids": list(job.pids),
            "gpus_total": job.gpus_total.value, "watchdog_s": job.watchdog_s.value,
            "effective_ib_timeout_s": job.effective_ib_timeout_s.value
            if job.effective_ib_timeout_s.value != float("inf") else None,
        }
