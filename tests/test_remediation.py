"""The remediation engine driven through time with a controlled clock: a scheduler outage delays and loses nothing,
a refusal is recorded, the dry run never reaches the scheduler, a restart reconciles instead of replaying, the
circuit breaker latches until reset, the recovery steps and the spare swap record what they did."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_scheduler import DictScheduler
from gpuwarden.agent.act import breaker
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.remediation import (
    STATUS_KEY,
    Engine,
    Hooks,
    Settings,
    _reason,
    finding_text,
    read_actions,
)
from gpuwarden.agent.act.remediation_breaker import RESET_AT_KEY
from gpuwarden.agent.core.scheduler import Busy, Transient

ME = "tray03"


@dataclass(frozen=True)
class Verdict:
    allow: bool
    reason: str
    cluster: tuple
    domain: tuple | None


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Journal:
    """What the daemon does with the engine's hooks: outcomes in order, meta values, the store's reset time."""

    def __init__(self):
        self.done: list[tuple[str, str]] = []
        self.meta: dict = {}
        self.clear = False

    def hooks(self) -> Hooks:
        return Hooks(done=lambda key, at, outcome: self.done.append((key, outcome)),
                     set_meta=self.meta.__setitem__, fault_clear=lambda: self.clear, read_meta=self.meta.get)

    def outcomes(self) -> list[str]:
        return [o for _, o in self.done]


def fleet(n: int = 4, **mine) -> dict:
    nodes = {f"tray{i:02d}": {"domain": "rack07"} for i in range(n)}
    nodes[ME] = {"domain": "rack07", **mine}
    return nodes


def intents(*actions: str, at: float = 1000.0, reason: str = "xid/79 on GPU0") -> list:
    return [(f"{at:.6f}:k:{a}", a, {"at": at, "reason": reason}) for a in actions]


def allow(nodes, node, domain, now, policy, reset_at=None):
    """A breaker verdict that lets every cordon through (the gate's own tests construct the others)."""
    return Verdict(True, "allowed", (1, len(nodes)), None)


def engine(sched, journal, clock, tmp_path: Path, mode: str = "act", **kw) -> Engine:
    kw.setdefault("judge", allow)
    settings = Settings(mode=mode, node_name=ME, retry_min_s=1.0, retry_max_s=8.0,
                        actions_path=tmp_path / "actions.jsonl", **kw.pop("settings", {}))
    return Engine(sched, settings, journal.hooks(), clock=clock, **kw)


def run(e: Engine, clock: Clock, turns: int = 50, until=None) -> list[float]:
    """Turns of the worker, the clock moved by what each turn asked to wait (no real sleeping)."""
    waits = []
    for _ in range(turns):
        if until is not None and until():
            break
        wait = e.step()
        waits.append(wait)
        if wait == float("inf"):
            break
        clock.t += wait
    return waits


def sample(e: Engine, name: str, **labels) -> float:
    (value,) = [s.value for s in e.samples() if s.name == name and s.labels == labels]
    return value


def test_an_outage_delays_and_loses_nothing_in_order(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(), clock=clock)
    e = engine(sched, journal, clock, tmp_path)
    e.enqueue(intents("cordon", "drain", "quarantine"))
    sched.outage = "slurmctld not responding"
    waits = run(e, clock, turns=6)
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # the backoff doubles up to retry_max_s
    assert sched.changes == [] and journal.done == []  # nothing lost, nothing marked done
    assert len(e.pending()) == 3 and sample(e, "gpuwarden_scheduler_reachable") == 0.0
    assert journal.meta[STATUS_KEY]["scheduler_error"] == "slurmctld not responding"
    sched.outage = None
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("cordon", ME), ("drain", ME), ("quarantine", ME)]  # each once, in order
    assert [k.rsplit(":", 1)[1] for k, _ in journal.done] == ["cordon", "drain", "quarantine"]
    assert journal.outcomes() == ["done", "done", "done"]
    assert sample(e, "gpuwarden_scheduler_reachable") == 1.0
    assert sched.state(ME)["reason"].startswith("gpuwarden: xid/79")  # our prefix and the finding


def test_a_scheduler_that_answers_later_is_reachable_and_status_says_what_the_intent_waits_for(tmp_path):
    """A PodDisruptionBudget holds the drain (the API server answered 429 for an eviction): the intent waits with the
    same backoff as in an outage, nothing behind it jumps the queue, but the scheduler is reachable, and status names
    what it waits for, not an error. An outage that came before is over once the scheduler answers again."""
    clock, journal = Clock(), Journal()
    pdb = "drain tray03: a PodDisruptionBudget forbids evicting team-a/train-0 now (429); retry later"

    class Budget(DictScheduler):
        held = True

        def drain(self, node, reason):
            if self.held:
                self._call("drain", node)
                raise Busy(pdb)
            super().drain(node, reason)

    sched = Budget(fleet(), clock=clock)
    e = engine(sched, journal, clock, tmp_path)
    e.enqueue(intents("cordon", "drain", "quarantine"))
    sched.outage = "slurmctld not responding"
    run(e, clock, turns=2)
    assert sample(e, "gpuwarden_scheduler_reachable") == 0.0  # not reached: unreachable
    sched.outage = None
    waits = run(e, clock, turns=6)
    # The cordon at its third try; then the drain, held: the same backoff as an outage's, up to retry_max_s.
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert sched.changes == [("cordon", ME)] and journal.outcomes() == ["done"]
    assert len(e.pending()) == 2  # the drain waits at the head, the quarantine behind it: nothing lost
    assert sample(e, "gpuwarden_scheduler_reachable") == 1.0
    status = journal.meta[STATUS_KEY]
    assert status["scheduler_waiting"] == pdb and status["scheduler_error"] is None
    since = status["scheduler_waiting_since"]
    assert isinstance(since, float) and since < clock.t  # since the first answer "later", not the last
    sched.held = False
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("cordon", ME), ("drain", ME), ("quarantine", ME)]
    assert journal.outcomes() == ["done", "done", "done"]
    assert journal.meta[STATUS_KEY]["scheduler_waiting"] is None
    assert sample(e, "gpuwarden_intents_carried_out", outcome="done") == 3.0


def test_status_says_what_an_intent_waits_for(tmp_path, capsys):
    from gpuwarden.agent.cli.main import main
    from gpuwarden.agent.state.store import Store

    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(service="cordoned", ours=True, jobs=3), clock=clock)
    e = engine(sched, journal, clock, tmp_path, node=SimpleNamespace(info=SimpleNamespace(boot_id="boot-1")),
               recovery=SimpleNamespace(reboot=lambda *a: pytest.fail("rebooted over running work")))
    e.enqueue([("k:reboot", "reboot", {"at": 1.0, "reason": "recovery: reboot", "boot_id": "boot-1"})])
    run(e, clock, turns=2)
    store = Store(tmp_path / "state" / "state.db")
    store.commit(meta={STATUS_KEY: journal.meta[STATUS_KEY]})  # what the daemon's set_meta hook writes
    store.close()
    assert main(["status", "--state-dir", str(tmp_path / "state")]) == 0
    text = capsys.readouterr().out
    assert "waiting since" in text and "3 job(s) still running on the node; the reboot waits" in text
    assert "unreachable" not in text


def test_the_scheduler_reason_names_check_code_gpu_and_pci_compactly(tmp_path):
    """The reason an operator reads in `sinfo -R`: `gpuwarden: xid 79 GPU3 0000:1b:00.0`, from the finding the
    intent carries; an intent journalled without one keeps the transition's reason."""
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(), clock=clock)
    e = engine(sched, journal, clock, tmp_path)
    finding = {"check": "xid", "code": "79", "status": "fail", "message": "GPU has fallen off the bus",
               "action": "REBOOT", "evidence": {"count": 1},
               "entity": {"kind": "gpu", "id": "GPU-5c1e", "index": 3, "pci": "0000:1b:00.0"}}
    e.enqueue([("1000.000000:k:cordon", "cordon", {"at": 1000.0, "reason": "xid/79 on GPU 3 GPU-5c1e 0000:1b:00.0",
                                                   "finding": finding})])
    run(e, clock, until=lambda: not e.pending())
    assert sched.state(ME)["reason"] == "gpuwarden: xid 79 GPU3 0000:1b:00.0"
    assert finding_text({**finding, "entity": {"kind": "nvlink", "id": "GPU-5c1e/5", "index": 0, "link": 5},
                         "check": "nvlink_lanes", "code": "nvlink-down"}) == "nvlink_lanes nvlink-down GPU0 link 5"
    assert finding_text({**finding, "entity": {"kind": "ib_port", "id": "mlx5_1/1"}, "check": "ib_port",
                         "code": "ib-port-down"}) == "ib_port ib-port-down ib_port mlx5_1/1"
    assert finding_text(None) == "" and finding_text({"check": "xid"}) == ""
    assert _reason({"reason": "could not\nlook: xid"}) == "gpuwarden: could not look: xid"


def test_a_refusal_is_recorded_and_counted_and_the_queue_goes_on(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(service="drained", reason="admin: bad PSU", ours=False), clock=clock)
    e = engine(sched, journal, clock, tmp_path)
    e.enqueue(intents("resume", "publish_domain"))
    run(e, clock, until=lambda: not e.pending())
    assert journal.outcomes()[0].startswith("refused: ") and "not ours" in journal.outcomes()[0]
    assert sched.state(ME)["service"] == "drained"  # an administrator's drain is never undone
    assert sample(e, "gpuwarden_intents_carried_out", outcome="refused") == 1.0


def test_dry_run_never_calls_the_scheduler(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(), clock=clock)
    e = engine(sched, journal, clock, tmp_path, mode="dry-run", domain="rack07")
    e.enqueue(e.start(clock()))
    e.enqueue(intents("cordon", "drain", "quarantine", "take_spare", "reboot", "ticket"))
    run(e, clock, until=lambda: not e.pending())
    assert sched.calls == []  # not even a read
    logged = read_actions(tmp_path / "actions.jsonl")
    assert [a["action"] for a in logged] == ["publish_domain", "cordon", "drain", "quarantine", "take_spare",
                                            "reboot", "ticket"]
    assert all(o.startswith("dry-run") for o in journal.outcomes())
    assert sample(e, "gpuwarden_remediation_acting") == 0.0


def test_a_restart_reconciles_instead_of_replaying(tmp_path):
    """The crash came after the scheduler drained and quarantined the node, before the journal marked the intents
    done: the next start reads the node's state and marks them done without a second call."""
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(service="drained", reason="gpuwarden: xid/79", ours=True, quarantined=True),
                          clock=clock)
    e = engine(sched, journal, clock, tmp_path)
    e.enqueue(intents("cordon", "drain", "quarantine"))
    run(e, clock, until=lambda: not e.pending())
    assert [c for c, _ in sched.calls] == ["node", "node", "node"]  # reads only
    assert sched.changes == []
    assert all(o.startswith("already so at the scheduler (drained, ours, quarantined") for o in journal.outcomes())


def test_a_call_that_timed_out_after_taking_effect_is_not_repeated(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(), clock=clock)

    class TimesOutAfter(DictScheduler):
        pass

    real = sched.drain

    def drain(node, reason):  # the scheduler did it, the answer never came
        real(node, reason)
        from gpuwarden.agent.core.scheduler import Transient
        raise Transient("timed out after 5 s")

    sched.drain = drain
    e = engine(sched, journal, clock, tmp_path)
    e.enqueue(intents("drain"))
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("drain", ME)]
    assert journal.outcomes() == ["already so at the scheduler (drained, ours)"]


# -- the circuit breaker's gate (the verdict as agent/act/breaker.py gives it)
# -------------------------------------------
def test_the_breaker_latches_until_reset_and_nothing_is_lost(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(), clock=clock)
    asked = []

    def judge(nodes, node, domain, now, policy, reset_at=None):
        asked.append(reset_at)
        if reset_at is None:
            return Verdict(False, "3 of 5 nodes drained by us in 600 s (limit 10 %)", (3, 5), (3, 5))
        return Verdict(True, "1 of 5", (1, 5), (1, 5))

    e = engine(sched, journal, clock, tmp_path, judge=judge, domain="rack07")
    e.enqueue(intents("cordon", "drain"))
    waits = run(e, clock, turns=5)
    assert waits == [5.0] * 5 and len(asked) == 1  # latched: not asked again until a reset
    assert sched.changes == [] and journal.done == [] and len(e.pending()) == 2  # waiting, neither lost nor done
    assert sample(e, "gpuwarden_breaker_open") == 1.0
    status = journal.meta[STATUS_KEY]["breaker"]
    assert status["reason"].startswith("3 of 5") and status["cluster"] == [3, 5]
    # A restart keeps the latch (the status is the store's).
    again = engine(sched, journal, clock, tmp_path, judge=judge, domain="rack07")
    again.enqueue(intents("cordon", "drain"))
    run(again, clock, turns=3)
    assert len(asked) == 1 and again.breaker_open
    reset_at = journal.meta[RESET_AT_KEY] = clock.t  # `gpuwarden breaker reset`
    run(again, clock, until=lambda: not again.pending())
    # Judged again, with the drains before the reset no longer counting: before the cordon, and after it (the fleet
    # read again with the drains of agents that acted at the same moment).
    assert asked == [None, reset_at, reset_at]
    assert sched.changes == [("cordon", ME), ("drain", ME)]
    assert sample(again, "gpuwarden_breaker_open") == 0.0 and journal.meta[STATUS_KEY]["breaker"] is None


def test_the_breaker_is_not_asked_for_a_node_already_out_of_service(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(service="cordoned", ours=True, reason="gpuwarden: x"), clock=clock)
    e = engine(sched, journal, clock, tmp_path,
               judge=lambda *a, **k: pytest.fail("asked the breaker about a node already cordoned"))
    e.enqueue(intents("drain"))
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("drain", ME)]


# -- recovery steps --------------------------------------------------------------------------------------------------
def test_a_reboot_the_journal_saw_start_is_done_once_the_boot_changed(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(service="drained", ours=True, quarantined=True), clock=clock)
    node = SimpleNamespace(info=SimpleNamespace(boot_id="boot-2"))
    e = engine(sched, journal, clock, tmp_path, node=node,
               recovery=SimpleNamespace(reboot=lambda *a: pytest.fail("rebooted twice")))
    e.enqueue([("k:reboot", "reboot", {"at": 1.0, "reason": "recovery: reboot", "boot_id": "boot-1"})])
    run(e, clock, until=lambda: not e.pending())
    assert journal.outcomes() == ["done: rebooted (boot boot-1 -> boot-2)"]


def test_a_reboot_waits_for_the_work_to_leave(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(service="cordoned", ours=True, jobs=2), clock=clock)
    node = SimpleNamespace(info=SimpleNamespace(boot_id="boot-1"))
    rebooted = []
    outcome = SimpleNamespace(ok=True, detail="systemctl reboot: exit 0")
    e = engine(sched, journal, clock, tmp_path, node=node,
               recovery=SimpleNamespace(reboot=lambda cmd, t: rebooted.append(cmd) or outcome))
    e.enqueue([("k:reboot", "reboot", {"at": 1.0, "reason": "recovery: reboot", "boot_id": "boot-1"})])
    run(e, clock, turns=3)
    assert rebooted == [] and len(e.pending()) == 1
    # The scheduler answered (work still runs): reachable, and status says what the reboot waits for.
    assert sample(e, "gpuwarden_scheduler_reachable") == 1.0
    status = journal.meta[STATUS_KEY]
    assert "2 job(s) still running" in status["scheduler_waiting"] and status["scheduler_error"] is None
    sched._data["nodes"][ME]["jobs"] = 0
    run(e, clock, until=lambda: not e.pending())
    assert rebooted == [["systemctl", "reboot"]] and journal.outcomes() == ["done: systemctl reboot: exit 0"]
    assert journal.meta[STATUS_KEY]["scheduler_waiting"] is None


def test_a_step_that_could_not_run_is_recorded_as_failed_never_as_done(tmp_path):
    clock, journal = Clock(), Journal()
    timed_out = SimpleNamespace(ok=None, detail="nvidia-smi timed out")
    e = engine(DictScheduler(fleet(), clock=clock), journal, clock, tmp_path, node=SimpleNamespace(),
               recovery=SimpleNamespace(reset_gpus=lambda node, gpus, t: timed_out))
    e.enqueue([("k:reset", "reset_gpu", {"at": 1.0, "reason": "recovery: reset_gpu", "gpus": [0]})])
    run(e, clock, until=lambda: not e.pending())
    assert journal.outcomes() == ["failed: could not run: nvidia-smi timed out"]
    assert sample(e, "gpuwarden_intents_carried_out", outcome="failed") == 1.0


def test_the_ticket_hook_gets_the_finding_and_the_idempotency_key(tmp_path):
    clock, journal = Clock(), Journal()
    got = []
    e = engine(DictScheduler(fleet(), clock=clock), journal, clock, tmp_path, domain="rack07",
               settings={"ticket_command": ("open-ticket",)},
               recovery=SimpleNamespace(open_ticket=lambda cmd, f, t: got.append((cmd, f)) or
                                        SimpleNamespace(ok=True, detail="ticket 42")))
    finding = {"check": "xid", "code": "79"}
    e.enqueue([("k:ticket", "ticket", {"at": 1.0, "reason": "recovery: ticket", "finding": finding})])
    run(e, clock, until=lambda: not e.pending())
    ((cmd, sent),) = got
    assert cmd == ["open-ticket"] and sent["finding"] == finding and sent["idempotency_key"] == "k:ticket"
    assert sent["node"] == ME and sent["domain"] == "rack07" and json.dumps(sent)
    assert journal.outcomes() == ["done: ticket 42"]


# -- the NVLink domain ----------------------------------------------------------------------------------------------
def test_the_domain_is_published_at_start_and_reasserted(tmp_path):
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(domain=None), clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", settings={"publish_every_s": 600.0})
    e.enqueue(e.start(clock()))
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("publish_domain", ME)] and journal.outcomes() == ["done"]
    sched._data["nodes"][ME]["domain"] = None  # slurmctld restarted and forgot the feature
    wait = e.step()
    assert wait == pytest.approx(600.0)
    clock.t += wait
    e.step()
    assert sched.changes == [("publish_domain", ME), ("publish_domain", ME)]
    assert sched.state(ME)["domain"] == "rack07"


def test_node_spare_follows_the_schedulers_view_of_this_node(tmp_path):
    """gpuwarden_node_spare (the fleet view's spares per domain) is what the scheduler showed when the engine last
    read this node: the start's publication reads it, another agent taking the spare shows at the next
    re-assertion, and this node returned to the pool shows at once."""
    clock, journal = Clock(), Journal()
    sched = DictScheduler(fleet(spare=True, service="drained", ours=True, reason="gpuwarden: spare"), clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", settings={"publish_every_s": 600.0})
    assert sample(e, "gpuwarden_node_spare") == 0.0  # not read yet
    e.enqueue(e.start(clock()))
    run(e, clock, until=lambda: not e.pending())
    assert sample(e, "gpuwarden_node_spare") == 1.0
    assert sched.take_spare("rack07", "tray00") == ME  # another node's agent takes this spare into service
    assert sample(e, "gpuwarden_node_spare") == 1.0  # not read since
    clock.t += e.step()
    e.step()  # the periodic re-assertion reads the node again
    assert sample(e, "gpuwarden_node_spare") == 0.0
    e.enqueue([("k:pool", "return_to_pool", {"at": clock.t, "reason": "retest passed", "domain": "rack07"})])
    run(e, clock, until=lambda: not e.pending())
    assert sched.state(ME)["spare"] and sample(e, "gpuwarden_node_spare") == 1.0


# -- with the policy modules (agent/act/breaker.py, agent/act/spares.py)
# -------------------------------------------------------
def test_the_real_breaker_holds_when_half_the_domain_is_drained(tmp_path):
    clock, journal = Clock(), Journal()
    nodes = fleet(8)
    for name in ("tray00", "tray01", "tray02", "tray04"):
        nodes[name].update(service="drained", ours=True, reason="gpuwarden: x", reason_since=clock.t - 10)
    sched = DictScheduler(nodes, clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", judge=None,
               settings={"breaker": {"cluster_share": 0.5, "domain_share": 0.25, "window_s": 600.0}})
    assert breaker.BreakerPolicy  # the engine builds it from [remediation.breaker]
    e.enqueue(intents("cordon"))
    run(e, clock, turns=3)
    assert sched.changes == [] and e.breaker_open


def test_a_cordon_that_raced_another_agent_past_the_limit_is_undone_and_the_breaker_latches(tmp_path):
    """Two agents judged the fleet at the same moment, each without the other's drain, and both cordoned: the fleet
    read again after the cordon shows both, past the limit of one, so this node's drain is undone (it is ours) and
    the breaker latches; the intents wait for a reset, neither lost nor done."""
    clock, journal = Clock(), Journal()

    class Racing(DictScheduler):
        def cordon(self, node, reason):
            super().cordon(node, reason)
            if node == ME:  # the other agent's cordon lands between this one's judgement and its own cordon
                self._change("cordon", "tray00", service="drained", reason="gpuwarden: xid 79 GPU1", ours=True,
                             reason_since=clock.t)

    sched = Racing(fleet(4), clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", judge=None,
               settings={"breaker": {"cluster_share": 0.2, "domain_share": 1.0, "window_s": 600.0}})
    e.enqueue(intents("cordon", "drain"))
    run(e, clock, turns=4)
    assert sched.changes == [("cordon", ME), ("cordon", "tray00"), ("resume", ME)]  # undone once
    assert sched.state(ME)["service"] == "in_service" and sched.state("tray00")["service"] == "drained"
    assert e.breaker_open and journal.done == [] and len(e.pending()) == 2
    assert "cluster 2 of 4 (limit 1)" in journal.meta[STATUS_KEY]["breaker"]["reason"]
    assert sample(e, "gpuwarden_breaker_open") == 1.0


def test_a_cordon_whose_second_judgement_could_not_read_the_fleet_is_judged_at_the_retry(tmp_path):
    """The read after the cordon failed (slurmctld went away): the retry finds the cordon there and judges it then,
    instead of taking "already so" for allowed."""
    clock, journal = Clock(), Journal()

    class Flaky(DictScheduler):
        lost = False

        def cordon(self, node, reason):
            super().cordon(node, reason)
            if node == ME:
                self._change("cordon", "tray00", service="drained", reason="gpuwarden: xid 79 GPU1", ours=True,
                             reason_since=clock.t)
                self.lost = True

        def nodes(self):
            if self.lost:
                self.lost = False
                raise Transient("slurmctld: connection refused")
            return super().nodes()

    sched = Flaky(fleet(4), clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", judge=None,
               settings={"breaker": {"cluster_share": 0.2, "domain_share": 1.0, "window_s": 600.0}})
    e.enqueue(intents("cordon", "drain"))
    run(e, clock, turns=4)
    assert sched.changes == [("cordon", ME), ("cordon", "tray00"), ("resume", ME)]
    assert e.breaker_open and journal.done == [] and len(e.pending()) == 2


def test_the_real_spare_plan_takes_a_spare_of_the_same_domain(tmp_path):
    clock, journal = Clock(), Journal()
    nodes = fleet(4, service="drained", ours=True, quarantined=True)
    nodes["spare-a"] = {"domain": "rack07", "spare": True, "service": "drained", "ours": True,
                        "reason": "gpuwarden: spare"}
    nodes["spare-b"] = {"domain": "rack08", "spare": True, "service": "drained", "ours": True,
                        "reason": "gpuwarden: spare"}
    sched = DictScheduler(nodes, clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07")
    e.enqueue([("k:swap", "take_spare", {"at": 1.0, "reason": "quarantined", "domain": "rack07"})])
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("take_spare", "spare-a")]
    assert journal.outcomes() == ["done: spare spare-a of rack07 taken into service"]


def quarantine_intents(at: float = 1000.0) -> list:
    """The intents of HEALTHY -> QUARANTINED in a known domain, as the daemon journals them (agent/act/intents.py)."""
    base = {"at": at, "from": "healthy", "to": "quarantined", "reason": "xid/79 on GPU0"}
    return [(f"{at:.6f}:healthy->quarantined:{a}", a, {**base, **extra})
            for a, extra in (("cordon", {}), ("drain", {}), ("take_spare", {"domain": "rack07"}))]


def test_no_spare_is_taken_for_a_node_whose_quarantine_was_refused(tmp_path):
    """An administrator drained the node before its fault: the agent's quarantine is refused (not ours to take
    over), so the agent did not take the node out of service and takes no spare in its place; the spare stays in
    the pool. A restart between the refusal and the swap reaches the same answer from the scheduler's view."""
    clock, journal = Clock(), Journal()
    sched = LocalAdapter(tmp_path / "scheduler.jsonl", clock=clock)  # the embedded scheduler, whole contract
    sched.publish_domain(ME, "rack07")
    sched.return_to_pool("spare-a", "rack07")
    sched.admin_drain(ME, "admin: bad fan")
    e = engine(sched, journal, clock, tmp_path, domain="rack07")
    e.enqueue(quarantine_intents())
    run(e, clock, until=lambda: not e.pending())
    cordon, drain, swap = journal.outcomes()
    assert cordon.startswith("already so at the scheduler (drained")
    assert drain.startswith("refused: ") and "admin: bad fan" in drain
    assert swap.startswith("refused: no spare taken: tray03 is not quarantined by gpuwarden (held by someone else: "
                           "admin: bad fan)")
    assert sched.spares("rack07") == ["spare-a"] and sched.node("spare-a").spare
    assert not [a for a in sched.actions() if a["action"] == "take_spare"]  # never asked
    assert sched.node(ME).reason == "admin: bad fan" and not sched.node(ME).ours
    assert e.status()["swap"] is None and sample(e, "gpuwarden_slice_must_move") == 0.0

    (key, action, detail) = quarantine_intents()[-1]
    restarted = Journal()
    again = engine(sched, restarted, clock, tmp_path, domain="rack07")
    again.enqueue([(key, action, detail)])  # the swap left pending by a crash after the refusal was journalled
    run(again, clock, until=lambda: not again.pending())
    assert restarted.outcomes() == [swap] and sched.spares("rack07") == ["spare-a"]


def test_a_spare_is_taken_for_a_node_the_agent_quarantined(tmp_path):
    """The counterpart, on the same embedded scheduler: the quarantine is the agent's, and the domain's spare goes
    into service in the node's place."""
    clock, journal = Clock(), Journal()
    sched = LocalAdapter(tmp_path / "scheduler.jsonl", clock=clock)
    sched.publish_domain(ME, "rack07")
    sched.return_to_pool("spare-a", "rack07")
    e = engine(sched, journal, clock, tmp_path, domain="rack07")
    e.enqueue(quarantine_intents())
    run(e, clock, until=lambda: not e.pending())
    assert journal.outcomes() == ["done", "done", "done: spare spare-a of rack07 taken into service"]
    assert sched.node(ME).quarantined and sched.spares("rack07") == []
    assert sched.node("spare-a").service.value == "in_service"


class SlurmLike(DictScheduler):
    """As slurmctld does it: a node's reason time moves whenever the reason changes (cordon -> quarantine)."""

    def quarantine(self, node, reason):
        super().quarantine(node, reason)
        with self._lock:
            n = self._data["nodes"][node]
            if n["reason"] == reason and n.get("reason_since") is not None:
                n["reason_since"] = self.clock()


def test_the_breaker_judges_this_node_as_one_more_never_by_its_place_among_the_drained(tmp_path):
    """The breaker's order among drained nodes is the scheduler's reason time, which Slurm moves when our reason
    changes: so the engine never asks for it. Before a cordon and after it, this node is judged as one more on top
    of the fleet's other drains; once out of service, its next steps are not judged again, so a start that moved
    later (the quarantine) cannot take back a drain that was kept."""
    clock, journal = Clock(), Journal()
    seen = []

    def judge(fleet, node, domain, now, policy, reset_at=None):
        seen.append(sorted(v.name for v in fleet if v.ours))
        assert node not in {v.name for v in fleet}, "judged by its own place among the drained"
        return breaker.judge(fleet, node, domain, now, breaker.BreakerPolicy(**policy), reset_at)

    nodes = fleet(6)
    nodes["tray00"].update(service="drained", ours=True, reason="gpuwarden: xid 79 GPU1", reason_since=clock.t - 50)
    sched = SlurmLike(nodes, clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", judge=judge,
               settings={"breaker": {"cluster_share": 0.34, "domain_share": 1.0, "window_s": 600.0}})  # limit 2
    e.enqueue(quarantine_intents()[:2])
    run(e, clock, turns=1)
    assert sched.changes == [("cordon", ME)] and seen == [["tray00"], ["tray00"]]  # before and after the cordon
    # Another agent's drain lands (tray01, later than this node's cordon), then the quarantine moves this node's
    # start past it: ranked by start, this node would now be third of three, past the limit of two.
    clock.t += 5
    sched._change("cordon", "tray01", service="drained", reason="gpuwarden: xid 79 GPU2", ours=True,
                  reason_since=clock.t)
    clock.t += 5
    run(e, clock, until=lambda: not e.pending())
    assert sched.changes == [("cordon", ME), ("cordon", "tray01"), ("quarantine", ME)]  # kept, never undone
    assert sched.state(ME)["reason_since"] == clock.t  # moved, as Slurm moves it
    assert len(seen) == 2 and not e.breaker_open and journal.outcomes() == ["done", "done"]
    ranked = breaker.judge(list(sched.nodes()), ME, "rack07", clock.t, breaker.BreakerPolicy(cluster_share=0.34))
    assert not ranked.allow and "drained 3rd" in ranked.reason  # what asking for the rank would have answered


def test_a_stale_mark_of_ours_on_a_node_in_service_does_not_let_it_past_the_gate(tmp_path):
    """Our condition left on a node that is back in service (Kubernetes: the taint was taken off by hand) makes the
    scheduler list it as drained by us, since long ago. Judged by its place, it would come first and pass the gate,
    be cordoned, and then be undone by the judgement after the cordon; judged as one more, it is held at the gate and
    nothing is written."""
    clock, journal = Clock(), Journal()
    nodes = fleet(5, ours=True, reason="gpuwarden: cordoned", reason_since=clock.t - 100)
    nodes["tray00"].update(service="drained", ours=True, reason="gpuwarden: xid 79 GPU1", reason_since=clock.t - 10)
    sched = DictScheduler(nodes, clock=clock)
    e = engine(sched, journal, clock, tmp_path, domain="rack07", judge=None,
               settings={"breaker": {"cluster_share": 0.2, "domain_share": 1.0, "window_s": 600.0}})  # limit 1
    e.enqueue(intents("cordon"))
    run(e, clock, turns=2)
    assert sched.changes == [] and e.breaker_open and len(e.pending()) == 1
    assert "cluster 2 of 5 (limit 1)" in journal.meta[STATUS_KEY]["breaker"]["reason"]


# -- `gpuwarden breaker reset` and `gpuwarden status` ---------------------------------------------------------------
def test_breaker_reset_is_recorded_for_the_daemon_and_status_says_why_it_held(tmp_path, capsys):
    from gpuwarden.agent.cli.main import main
    from gpuwarden.agent.state.store import Store
    from gpuwarden.agent.state.transitions import NodeRecord, NodeState

    state = tmp_path / "state"
    store = Store(state / "state.db", lock=True)  # the daemon holds the folder meanwhile
    latch = {"open": True, "since": 100.0, "reason": "rack07: 5 of 18 nodes drained by us in 600 s (limit 25 %)",
             "cluster": [5, 72], "domain": [5, 18]}
    store.commit(node=NodeRecord(NodeState.QUARANTINED, 90.0, "xid/79 on GPU 0", step="reboot", step_since=95.0),
                 meta={STATUS_KEY: {"mode": "act", "adapter": "slurm", "domain": "rack07", "breaker": latch}},
                 intents=[("k:reboot", "reboot", {"at": 95.0})], done=[("k:reboot", 96.0, "done: exit 0")])
    assert main(["status", "--state-dir", str(state)]) == 0
    text = capsys.readouterr().out
    assert "circuit breaker OPEN" in text and "rack07: 5 of 18" in text and "gpuwarden breaker reset" in text
    assert "recovery step: reboot" in text and "done: exit 0" in text
    assert main(["breaker", "reset", "--state-dir", str(state)]) == 0
    capsys.readouterr()
    assert isinstance(store.meta(RESET_AT_KEY), float)  # what the running daemon reads at its next turn
    assert main(["status", "--state-dir", str(state), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["remediation"]["breaker"]["reason"].startswith("rack07") and doc["remediation"]["breaker_reset_at"]
    assert doc["remediation"]["ladder"] == {"step": "reboot", "since": 95.0, "outcome": "done: exit 0"}
    store.close()
    assert main(["breaker", "reset", "--state-dir", str(tmp_path / "nowhere")]) == 2


# -- the [remediation] table -----------------------------------------------------------------------------------------
def test_remediation_config_is_checked_and_documented(tmp_path):
    from conftest import ROOT
    from gpuwarden.agent.core import config
    from gpuwarden.agent.core.errors import ConfigError
    from gpuwarden.checks import all_specs

    specs = all_specs()
    path = tmp_path / "gpuwarden.toml"
    path.write_text('[remediation]\nmode = "act"\nadapter = "slurm"\n[remediation.breaker]\ndomain_share = 0.5\n'
                    '[remediation.ladder]\nticket_command = ["/usr/local/bin/ticket", "--queue", "gpu"]\n'
                    '[remediation.slurm]\ntimeout_s = 10\nscontrol = "/usr/bin/scontrol"\n[topology]\ndomain = "r7"\n')
    cfg = config.load(specs, path, explicit=True)
    assert cfg.remediation["mode"] == "act" and cfg.remediation["breaker"]["domain_share"] == 0.5
    assert cfg.remediation["breaker"]["cluster_share"] == 0.10  # the rest of a sub-table keeps its defaults
    assert cfg.remediation["slurm"] == {"timeout_s": 10.0, "scontrol": "/usr/bin/scontrol"}
    assert cfg.topology["domain"] == "r7"
    settings = Settings.from_table(cfg.remediation, "host1", None)
    assert settings.acting and settings.node_name == "host1"
    assert settings.ticket_command == ("/usr/local/bin/ticket", "--queue", "gpu")
    assert config.defaults(specs).remediation["mode"] == "dry-run"  # never acts unless told
    for text, needle in [('[remediation]\nmode = "yes"\n', "remediation.mode"),
                         ('[remediation.breaker]\ncluster_share = 1.5\n', "remediation.breaker.cluster_share"),
                         ('[remediation.ladder]\nreboot_comand = ["x"]\n', "remediation.ladder.reboot_comand"),
                         ('[remediation.slurm]\ntimeout_s = inf\n', "remediation.slurm.timeout_s"),
                         ('[remediation]\nbreaker = 3\n', "remediation.breaker")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            config.load(specs, path, explicit=True)
    doc = (ROOT / "docs" / "configuration.md").read_text().split("## Remediation", 1)[1]
    for key, value in config.REMEDIATION_DEFAULTS.items():
        table = f"[remediation.{key}]" if isinstance(value, dict) else "[remediation]"
        assert table in doc, table
        for sub in value if isinstance(value, dict) else []:
            assert f"\n{sub} =" in doc.split(table, 1)[1].split("\n[", 1)[0], f"remediation.{key}.{sub}"
        if not isinstance(value, dict):
            assert f"\n{key} =" in doc.split("[remediation]", 1)[1].split("\n[", 1)[0], key


def test_an_adapter_is_built_by_name_and_a_bad_table_names_itself(tmp_path):
    from gpuwarden.agent.act.adapters import build
    from gpuwarden.agent.core.errors import ConfigError

    assert build("local", {}, tmp_path).path == tmp_path / "actions.jsonl"
    with pytest.raises(ConfigError, match=r"\[remediation\.local\]"):
        build("local", {"no_such_keyword": 1}, tmp_path)
    with pytest.raises(ConfigError, match="unknown adapter"):
        build("pbs", {}, tmp_path)
