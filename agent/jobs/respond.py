"""Carrying out one job intent (a doomed job) through the scheduler adapter, as the remediation engine's worker does
for every intent: reconciled against the scheduler first, each step idempotent, the outcome in words.

- **Reconcile.** The job is read at the scheduler before anything is done. A job that is no longer the run the agent
  saw doomed (it ended, was requeued, restarted since, runs elsewhere) or that gpuwarden already acted on for this run
  (its mark: another node's agent saw the same fabric fault, or this agent before a restart) is left alone: `already
  so at the scheduler`. So one fault seen by several of the job's nodes ends the job once, and a restart neither
  repeats nor loses an action.
- **The policy** (`[jobs] on_doomed`): `notify` writes the reason only; `signal` sends the signal (default USR1) to
  every process of the job, so it can checkpoint and exit; `requeue` puts a requeueable job back in the queue
  (signalled `signal_before_s` first when that is set; a job that cannot be requeued is signalled, never cancelled);
  `cancel` ends it.
- **The reason** goes where the job's owner and the administrator see it (Slurm: AdminComment; Kubernetes: an Event
  and the pod condition `GpuwardenJobDoomed`): `gpuwarden: requeued on n1: xid 79 GPU2 0018:01:00.0 (its GPU 2)
  [run 0]`. The mark is written before an action that ends the job (afterwards it may no longer take one) and after a
  signal (a signal lost to a crash between the two would leave the job idling; one sent twice is harmless).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.core.scheduler import REASON_PREFIX, JobView

JOB_ACTION = "job"  # a job intent's action in the journal: made by agent/jobs/guard.py, run by agent/act/remediation.py
POLICIES = ("notify", "signal", "requeue", "cancel")
_RUN = re.compile(r"\[run (\d+)\]$")
# The verb of a `done: ...` outcome carry_out returns -> the action it took (gpuwarden_job_actions_total{action}).
_DONE_VERBS = {"notified": "notify", "signalled": "signal", "requeued": "requeue", "cancelled": "cancel"}
JOB_ACTION_KINDS = (*_DONE_VERBS.values(), "dry_run")  # "dry_run": an intent a dry run logged, not carried out


class Deferred(Exception):
    """The job was signalled and is requeued later (`signal_before_s`): the intent waits until `until`, without
    holding up the intents behind it."""

    def __init__(self, until: float, progress: dict[str, Any]):
        super().__init__(f"requeue at {until:.0f}")
        self.until, self.progress = until, progress


def mark_text(verb: str, node: str, reason: str, run: int | None) -> str:
    """`gpuwarden: requeued on n1: <reason> [run 0]`: the run in brackets tells this run's mark from an earlier one's
    (Slurm keeps a job's AdminComment across its requeues)."""
    tail = f" [run {run}]" if run is not None else ""
    return f"{REASON_PREFIX} {verb} on {node}: {' '.join(reason.split())[:300]}{tail}"


def marked_run(view: JobView) -> int | None:
    """The run a mark of ours names (None: no mark of ours, or one without a run)."""
    if not view.mark or not view.mark.startswith(REASON_PREFIX):
        return None
    m = _RUN.search(view.mark.strip())
    return int(m[1]) if m else None


def left_alone(view: JobView | None, ref: JobRef, node: str) -> str | None:
    """Why the job is not (or no longer) the run this intent is about, or already had gpuwarden's answer; None when it
    is to be acted on."""
    if view is None:
        return f"{ref.label()} is no longer known to the scheduler"
    if view.state == "ended":
        return f"{ref.label()} has ended"
    if view.state == "pending":
        return f"{ref.label()} is pending (requeued since)"
    if view.state == "ending":
        return f"{ref.label()} is ending"
    if ref.run is not None and view.run is not None and view.run != ref.run:
        return f"{ref.label()} has restarted since (now run {view.run})"
    if view.nodes and node not in view.nodes:
        return f"{ref.label()} no longer runs on {node} (on {', '.join(view.nodes[:8])})"
    if view.mark and view.mark.startswith(REASON_PREFIX) and (ref.scheduler != "slurm" or marked_run(view) == ref.run):
        return f"{ref.label()} already has gpuwarden's answer: {view.mark[:200]}"
    return None


def carry_out(adapter: Any, detail: Mapping[str, Any], node: str, now: float,
              progress: Mapping[str, Any] | None = None) -> str:
    """Does what the intent's policy says to its job; returns the outcome ("done: ...", "already so at the scheduler
    (...)"). Raises Deferred while a signalled job waits for its requeue, and the adapter's Transient / Busy /
    Refused as every intent does."""
    ref = JobRef.from_dict(detail["job"])
    policy = str(detail.get("policy", "notify"))
    signal = str(detail.get("signal") or "USR1")
    reason = str(detail.get("reason", ""))
    before_s = float(detail.get("signal_before_s") or 0.0)
    signalled = progress is not None and progress.get("signalled_at") is not None
    view = adapter.job(ref)
    if signalled and view is not None and view.state == "running":
        # Signalled before (this run of the agent or the one before it): only the requeue is left, after the wait.
        at = float(progress["signalled_at"])  # type: ignore[index]
        if now < at + before_s:
            raise Deferred(at + before_s, dict(progress or {}))
        if view.run is None or ref.run is None or view.run == ref.run:
            adapter.mark_job(ref, mark_text(f"requeued {before_s:g} s after {signal}", node, reason, ref.run))
            if adapter.requeue_job(ref) is False:
                return f"already so at the scheduler ({ref.label()} was requeued meanwhile, after the {signal})"
            return f"done: requeued {ref.label()} {before_s:g} s after {signal}"
    why = left_alone(view, ref, node)
    if why is not None:
        if signalled:
            return f"done: signalled {ref.label()} with {signal}; {why}"
        if view is not None and view.mark and marked_run(view) == ref.run and " signalled " in f" {view.mark} " \
                and policy == "requeue" and view.state == "running":
            # Our own signal-first mark, the progress lost to a restart: the wait starts again from now.
            raise Deferred(now + before_s, {"signalled_at": now})
        return f"already so at the scheduler ({why})"
    assert view is not None
    if policy == "notify":
        adapter.mark_job(ref, mark_text("doomed, notified", node, reason, ref.run))
        return f"done: notified: the reason is on {ref.label()}"
    if policy == "cancel":
        adapter.mark_job(ref, mark_text("cancelled", node, reason, ref.run))
        adapter.cancel_job(ref)
        return f"done: cancelled {ref.label()}"
    if policy == "requeue" and view.requeueable is not False:
        if before_s > 0:
            adapter.signal_job(ref, signal)
            adapter.mark_job(ref, mark_text(f"signalled {signal}, requeue in {before_s:g} s", node, reason, ref.run))
            raise Deferred(now + before_s, {"signalled_at": now})
        adapter.mark_job(ref, mark_text("requeued", node, reason, ref.run))
        if adapter.requeue_job(ref) is False:
            return f"already so at the scheduler ({ref.label()} was requeued meanwhile, by another of its nodes)"
        return f"done: requeued {ref.label()}"
    # signal, or requeue of a job the scheduler will not requeue: signalled, never cancelled
    adapter.signal_job(ref, signal)
    not_requeueable = policy == "requeue"
    adapter.mark_job(ref, mark_text(f"signalled {signal}" + (" (not requeueable)" if not_requeueable else ""), node,
                                    reason, ref.run))
    return f"done: signalled {ref.label()} with {signal}" + (
        " (it is not requeueable: signalled, never cancelled)" if not_requeueable else "")


def action_taken(outcome: str) -> str | None:
    """The action an outcome of carry_out says was taken (`done: requeued Slurm job 7` -> "requeue"); None for one
    that took none (already so at the scheduler, refused, failed, superseded)."""
    if not outcome.startswith("done: "):
        return None
    return _DONE_VERBS.get(outcome[len("done: "):].split(" ", 1)[0].rstrip(":"))
