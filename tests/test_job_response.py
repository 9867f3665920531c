"""Carrying a doomed job's intent out (agent/jobs/respond.py) through the real remediation engine and the local
adapter's real SQLite scheduler: each policy, the reconcile that leaves a job alone (requeued, ended, restarted,
elsewhere, answered already), the signal-first wait that holds no other intent up, and what waits for the node."""
from __future__ import annotations

from pathlib import Path

import pytest
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.remediation import STATUS_KEY, Engine, Hooks, Settings
from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.core.scheduler import JobView
from gpuwarden.agent.jobs import respond

REF = JobRef("slurm", "4242", 0, "cgroup")
REASON = "xid 79 GPU0 0008:01:00.0 (its GPU 0)"


def detail(policy: str = "requeue", before_s: float = 0.0, **more) -> dict:
    return {"at": 100.0, "job": REF.to_dict(), "incident": "xid:xid:79:GPU-a:boot", "rule": "xid", "reason": REASON,
            "policy": policy, "signal": "USR1", "signal_before_s": before_s, "fault_at": 99.5, "watchdog_s": 600.0,
            "gpus_total": 8, **more}


@pytest.fixture
def local(tmp_path: Path) -> LocalAdapter:
    return LocalAdapter(tmp_path / "actions.jsonl", node_name="n1")


def actions(local: LocalAdapter, kind: str) -> list[dict]:
    return [a for a in local.actions() if a["action"] == kind and a["changed"]]


@pytest.mark.parametrize("policy, state, run, outcome, verbs", [
    ("notify", "running", 0, "done: notified: the reason is on Slurm job 4242", ["mark_job"]),
    ("signal", "running", 0, "done: signalled Slurm job 4242 with USR1", ["signal_job", "mark_job"]),
    ("requeue", "pending", 1, "done: requeued Slurm job 4242", ["mark_job", "requeue_job"]),
    ("cancel", "ended", 0, "done: cancelled Slurm job 4242", ["mark_job", "cancel_job"]),
])
def test_each_policy_does_what_it_says_and_marks_the_job(local, policy, state, run, outcome, verbs):
    assert respond.carry_out(local, detail(policy), "n1", 100.0) == outcome
    view = local.job(REF)
    assert (view.state, view.run) == (state, run)
    assert view.mark.startswith("gpuwarden: ") and view.mark.endswith(f"on n1: {REASON} [run 0]")
    assert [a["action"] for a in local.actions() if a["action"].endswith("_job")] == verbs


def test_a_job_that_cannot_be_requeued_is_signalled_never_cancelled(local):
    local.set_job(REF, "running", requeueable=False)
    out = respond.carry_out(local, detail("requeue"), "n1", 100.0)
    assert out == "done: signalled Slurm job 4242 with USR1 (it is not requeueable: signalled, never cancelled)"
    assert local.job(REF).state == "running" and not actions(local, "cancel_job") and not actions(local, "requeue_job")


class Scheduler:
    """A scheduler whose view of the job is given (the states the local adapter does not model)."""

    def __init__(self, view: JobView | None):
        self.view, self.calls = view, []

    def job(self, ref):
        return self.view

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name)


@pytest.mark.parametrize("view, why", [
    (None, "no longer known to the scheduler"),
    (JobView("4242", "ended"), "has ended"),
    (JobView("4242", "pending", run=1), "is pending (requeued since)"),
    (JobView("4242", "ending"), "is ending"),
    (JobView("4242", "running", ("n3", "n4"), run=1), "has restarted since (now run 1)"),
    (JobView("4242", "running", ("n3", "n4"), run=0), "no longer runs on n1 (on n3, n4)"),
    (JobView("4242", "running", ("n1", "n2"), run=0, mark="gpuwarden: requeued on n2: ib_port ... [run 0]"),
     "already has gpuwarden's answer"),
])
def test_a_job_that_is_not_the_doomed_run_or_answered_already_is_left_alone(view, why):
    s = Scheduler(view)
    out = respond.carry_out(s, detail("requeue"), "n1", 100.0)
    assert out.startswith("already so at the scheduler (") and why in out and s.calls == []


def test_an_earlier_runs_mark_does_not_stop_this_runs_action():
    s = Scheduler(JobView("4242", "running", ("n1", "n2"), run=1, mark="gpuwarden: requeued on n1: xid 79 [run 0]"))
    ref = JobRef("slurm", "4242", 1)
    assert respond.carry_out(s, {**detail("requeue"), "job": ref.to_dict()}, "n1", 100.0).startswith("done: requeued")
    assert s.calls == ["mark_job", "requeue_job"]


def test_signal_first_defers_the_requeue_and_then_requeues(local):
    with pytest.raises(respond.Deferred) as exc:
        respond.carry_out(local, detail("requeue", 30.0), "n1", 100.0)
    assert exc.value.until == 130.0 and exc.value.progress == {"signalled_at": 100.0}
    assert local.job(REF).state == "running" and local.job(REF).mark.startswith("gpuwarden: signalled USR1, requeue")
    with pytest.raises(respond.Deferred):  # too early: still waiting
        respond.carry_out(local, detail("requeue", 30.0), "n1", 120.0, exc.value.progress)
    out = respond.carry_out(local, detail("requeue", 30.0), "n1", 130.0, exc.value.progress)
    assert out == "done: requeued Slurm job 4242 30 s after USR1" and local.job(REF).state == "pending"
    assert len(actions(local, "signal_job")) == 1


def test_signal_first_after_a_restart_that_lost_its_progress_waits_again_and_never_signals_twice(local):
    with pytest.raises(respond.Deferred):
        respond.carry_out(local, detail("requeue", 30.0), "n1", 100.0)
    with pytest.raises(respond.Deferred) as exc:  # the agent restarted: no progress, but the job's mark says it
        respond.carry_out(local, detail("requeue", 30.0), "n1", 110.0)
    assert exc.value.until == 140.0 and len(actions(local, "signal_job")) == 1


# -- through the engine: the node first, the breaker, and no head-of-line wait ---------------------------------------
class Journal:
    def __init__(self):
        self.done, self.meta = {}, {}

    def hooks(self) -> Hooks:
        return Hooks(done=lambda key, at, outcome: self.done.__setitem__(key, outcome),
                     set_meta=self.meta.__setitem__, read_meta=self.meta.get)


def engine(local: LocalAdapter, journal: Journal, clock: list[float], **settings) -> Engine:
    return Engine(local, Settings(mode="act", node_name="n1", **settings), journal.hooks(), clock=lambda: clock[0])


def drain(eng: Engine) -> None:
    for _ in range(50):
        if eng.step() > 0 and not eng.ready(eng.clock()):
            break


def test_the_engine_acts_on_the_job_only_once_its_node_is_out_of_service(local):
    journal, clock = Journal(), [100.0]
    eng = engine(local, journal, clock)
    eng.enqueue([("job:a", "job", detail("requeue"))])
    drain(eng)
    assert journal.done["job:a"].startswith("refused: n1 is in service at the scheduler")
    assert local.job(REF).state == "running"
    eng.enqueue([("t:cordon", "cordon", {"at": 100.0, "to": "cordoned", "reason": "xid"}),
                 ("job:b", "job", detail("requeue"))])
    drain(eng)
    assert journal.done["t:cordon"] == "done" and journal.done["job:b"] == "done: requeued Slurm job 4242"
    counts = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in eng.samples()}
    assert counts[("gpuwarden_job_actions", (("action", "requeue"), ("reason", "xid")))] == 1.0
    assert counts[("gpuwarden_job_gpu_seconds_saved_estimate", (("action", "requeue"),))] == \
        pytest.approx((600.0 - 0.5) * 8)


def test_a_deferred_requeue_holds_no_other_intent_up_and_survives_a_restart(local, tmp_path):
    journal, clock = Journal(), [100.0]
    eng = engine(local, journal, clock)
    eng.enqueue([("t:cordon", "cordon", {"at": 100.0, "to": "cordoned", "reason": "xid"}),
                 ("job:a", "job", detail("requeue", 30.0)), ("t:ticket", "ticket", {"at": 100.0, "reason": "x"})])
    drain(eng)
    assert "job:a" not in journal.done and journal.done["t:ticket"].startswith("done")  # not held up by the wait
    assert [k for k, _, _ in eng.pending()] == ["job:a"]
    assert journal.meta[STATUS_KEY]["job_progress"] == {"job:a": {"signalled_at": 100.0}}
    # A restart: a new engine on the same journal and scheduler, the pending intent replayed.
    clock[0] = 131.0
    again = engine(local, journal, clock)
    again.enqueue([("job:a", "job", detail("requeue", 30.0))])
    drain(again)
    assert journal.done["job:a"] == "done: requeued Slurm job 4242 30 s after USR1"
    assert len(actions(local, "signal_job")) == 1 and journal.meta[STATUS_KEY]["job_progress"] == {}


def test_a_signalled_job_that_ends_before_its_requeue_is_counted_once(local):
    journal, clock = Journal(), [100.0]
    eng = engine(local, journal, clock)
    eng.enqueue([("t:cordon", "cordon", {"at": 100.0, "to": "cordoned", "reason": "xid"}),
                 ("job:a", "job", detail("requeue", 30.0))])
    drain(eng)
    local.set_job(REF, "ended")  # the job took the signal and ended on its own
    clock[0] = 131.0
    drain(eng)
    assert journal.done["job:a"].startswith("done: signalled") and journal.done["job:a"].endswith("has ended")
    counts = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in eng.samples()}
    assert counts[("gpuwarden_job_actions", (("action", "signal"), ("reason", "xid")))] == 1.0
    # What it saved is counted once, when the intent saw the job ended (31.5 s after the fault).
    assert counts[("gpuwarden_job_gpu_seconds_saved_estimate", (("action", "signal"),))] == \
        pytest.approx((600.0 - 31.5) * 8)


def test_in_dry_run_the_job_is_logged_never_acted_on(local, tmp_path):
    journal, clock = Journal(), [100.0]
    eng = Engine(local, Settings(mode="dry-run", node_name="n1", actions_path=tmp_path / "dry.jsonl"),
                 journal.hooks(), clock=lambda: clock[0])
    eng.enqueue([("job:a", "job", detail("cancel"))])
    drain(eng)
    assert journal.done["job:a"] == "dry-run: logged, not carried out"
    assert local.job(REF).state == "running" and '"action": "job"' in (tmp_path / "dry.jsonl").read_text()
