"""The local adapter: the embedded scheduler on one SQLite file (atomic spares across processes, idempotent calls,
ours-only resume, a file that is not a database), and the actions log the daemon writes through it."""
from __future__ import annotations

import json
import multiprocessing
import sqlite3
from pathlib import Path

import pytest
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.adapters.local_db import LocalDatabaseError
from gpuwarden.agent.act.breaker import BreakerPolicy, judge
from gpuwarden.agent.act.spares import SparePolicy, plan_swap, wants_back_in_pool
from gpuwarden.agent.core.scheduler import SPARE_REASON, Refused, SchedulerAdapter, Service, Transient
from gpuwarden.agent.state.store import Store


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def local(tmp_path, clock) -> LocalAdapter:
    return LocalAdapter(tmp_path / "state" / "actions.jsonl", db=tmp_path / "fleet" / "scheduler.db", clock=clock)


def seed_rack(a: LocalAdapter, domain: str, nodes: int = 16, spares: int = 2) -> None:
    for i in range(nodes):
        a.publish_domain(f"{domain}-n{i}", domain)
    for i in range(spares):
        a.return_to_pool(f"{domain}-s{i}", domain)


def snapshot(a: LocalAdapter) -> list:
    return list(a.nodes())


# -- the dry-run record the daemon writes today ------------------------------------------------------------------
def test_apply_records_what_would_be_done_and_touches_no_scheduler(tmp_path, clock):
    a = LocalAdapter(tmp_path / "actions.jsonl", clock=clock)
    a.apply("cordon", {"reason": "xid 79", "from": "healthy", "to": "cordoned"})
    a.apply("cordon", {"reason": "xid 79", "replayed": True})
    assert a.actions() == [{"action": "cordon", "at": clock.now, "reason": "xid 79", "from": "healthy",
                            "to": "cordoned"}, {"action": "cordon", "at": clock.now, "reason": "xid 79",
                                                "replayed": True}]
    assert not a.db.exists()  # nothing acted on
    with open(a.path, "a") as f:
        f.write('{"action": "dr')  # a line a crash left torn
    assert [x["action"] for x in a.actions()] == ["cordon", "cordon"]
    assert LocalAdapter(tmp_path / "none.jsonl").actions() == []
    named = LocalAdapter(tmp_path / "named.jsonl", node_name="gb200-n7", clock=clock)
    named.apply("drain", {"reason": "xid 79"})
    assert named.actions() == [{"action": "drain", "at": clock.now, "node": "gb200-n7", "reason": "xid 79"}]


def test_it_is_a_scheduler_adapter(local):
    adapter: SchedulerAdapter = local
    assert adapter.name == "local" and adapter.timeout_s == 5.0
    assert local.db.name == "scheduler.db"
    assert LocalAdapter(Path("/x/state/actions.jsonl")).db == Path("/x/state/local-scheduler.db")


# -- one node, no scheduler ------------------------------------------------------------------------------------------
def test_a_node_is_added_on_first_sight_in_service(local, clock):
    assert list(local.nodes()) == []
    v = local.node("gb200-n1")
    assert (v.name, v.service, v.reason, v.ours, v.domain, v.spare) == ("gb200-n1", Service.IN_SERVICE, None, False,
                                                                        None, False)
    local.cordon("gb200-n7", "gpuwarden: xid 79 GPU3 0000:1b:00.0")
    assert [v.name for v in local.nodes()] == ["gb200-n1", "gb200-n7"]
    v = local.node("gb200-n7")
    assert (v.service, v.reason, v.reason_since, v.ours) == (Service.CORDONED, "gpuwarden: xid 79 GPU3 0000:1b:00.0",
                                                             clock.now, True)


def test_the_ladder_on_one_node_and_what_the_log_says(local, clock):
    local.publish_domain("n1", "rack-a")
    local.cordon("n1", "xid 79 GPU3")  # a reason without the mark gets it: that is what makes it ours
    clock.now += 30
    local.drain("n1", "gpuwarden: xid 79 GPU3")
    clock.now += 30
    local.quarantine("n1", "gpuwarden: xid 79 GPU3")
    v = local.node("n1")
    assert (v.service, v.ours, v.quarantined, v.domain) == (Service.DRAINED, True, True, "rack-a")
    assert v.reason_since == clock.now - 60  # the drain began at the cordon (the breaker's window)
    local.resume("n1")
    v = local.node("n1")
    assert (v.service, v.reason, v.ours, v.quarantined) == (Service.IN_SERVICE, None, False, False)
    assert [(x["action"], x["node"], x["changed"], x.get("reason")) for x in local.actions()] == [
        ("publish_domain", "n1", True, None), ("cordon", "n1", True, "gpuwarden: xid 79 GPU3"),
        ("drain", "n1", True, "gpuwarden: xid 79 GPU3"), ("quarantine", "n1", True, "gpuwarden: xid 79 GPU3"),
        ("resume", "n1", True, None)]


def test_a_drain_with_work_left_shows_cordoned_until_the_work_ends(local):
    local.set_jobs("n1", 3)
    local.drain("n1", "gpuwarden: ecc")
    assert local.node("n1").service is Service.CORDONED
    local.set_jobs("n1", 0)
    assert local.node("n1").service is Service.DRAINED
    local.cordon("n1", "gpuwarden: ecc")  # never loosens a drain
    assert local.node("n1").service is Service.DRAINED
    local.set_down("n1")
    assert local.node("n1").service is Service.DOWN
    with pytest.raises(Refused, match="jobs"):
        local.set_jobs("n1", -1)


# -- idempotency: every call repeated changes nothing --------------------------------------------------------------
CALLS = {
    "cordon": lambda a: a.cordon("r0-n1", "gpuwarden: xid 79"),
    "drain": lambda a: a.drain("r0-n1", "gpuwarden: xid 79"),
    "quarantine": lambda a: a.quarantine("r0-n1", "gpuwarden: xid 79"),
    "resume": lambda a: a.resume("r0-n1"),
    "publish_domain": lambda a: a.publish_domain("r0-n1", "r9"),
    "take_spare": lambda a: a.take_spare("r0", "r0-n1"),
    "return_to_pool": lambda a: a.return_to_pool("r0-n1", "r0"),
    "node": lambda a: a.node("r0-new"),
    "spares": lambda a: a.spares("r0"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_call_repeated_is_a_no_op(local, clock, call):
    seed_rack(local, "r0", nodes=4, spares=2)
    if call == "resume":
        local.drain("r0-n1", "gpuwarden: xid 79")
    first = CALLS[call](local)
    after_one = snapshot(local)
    clock.now += 100  # a retry later must not move the drain's start either
    again = CALLS[call](local)
    assert snapshot(local) == after_one and again == first
    repeats = [x for x in local.actions() if x["action"] == call]
    if repeats:
        assert repeats[-1]["changed"] is False


def test_a_retried_take_spare_returns_the_spare_already_taken_until_the_node_is_back(local):
    seed_rack(local, "r0", nodes=4, spares=2)
    local.quarantine("r0-n1", "gpuwarden: xid 79")
    assert local.take_spare("r0", "r0-n1") == "r0-s0"
    assert local.take_spare("r0", "r0-n1") == "r0-s0" and local.spares("r0") == ["r0-s1"]
    assert local.node("r0-s0").service is Service.IN_SERVICE
    # Repaired and back in service: a later fault of the same node is a new swap, with a new spare.
    local.resume("r0-n1")
    local.quarantine("r0-n1", "gpuwarden: xid 48")
    assert local.take_spare("r0", "r0-n1") == "r0-s1"
    assert local.take_spare("r0", "r0-n2") is None  # the pool is empty
    # A repaired node back in the pool ends the link too.
    local.return_to_pool("r0-n1", "r0")
    assert local.spares("r0") == ["r0-n1"] and local.take_spare("r0", "r0-n2") == "r0-n1"


def test_only_healthy_spares_of_the_domain_are_taken(local):
    seed_rack(local, "r0", nodes=2, spares=3)
    seed_rack(local, "r1", nodes=2, spares=1)
    local.set_down("r0-s0")
    local.cordon("r0-s1", "gpuwarden: ecc")  # a spare with a fault of its own leaves the pool
    assert not local.node("r0-s1").spare
    assert local.spares("r0") == ["r0-s2"]
    assert local.take_spare("r0", "r0-n0") == "r0-s2"
    assert local.take_spare("r0", "r0-n1") is None  # never r1's spare, never the down one
    assert local.spares("r1") == ["r1-s0"]
    pooled = local.node("r1-s0")  # held out of service with our spare reason: ours, never counted as a fault
    assert (pooled.service, pooled.reason, pooled.ours, pooled.spare) == (Service.DRAINED, SPARE_REASON, True, True)


# -- ours only -----------------------------------------------------------------------------------------------------
def test_an_administrators_drain_is_never_undone_nor_taken_over(local):
    local.admin_drain("n1", "admin: PSU swap ticket 4411")
    held = local.node("n1")
    local.cordon("n1", "gpuwarden: xid 79")  # already out of service: nothing to do, nothing taken over
    local.drain("n1", "gpuwarden: xid 79")
    for call in (lambda: local.resume("n1"), lambda: local.quarantine("n1", "gpuwarden: xid 79"),
                 lambda: local.return_to_pool("n1", "r0")):
        with pytest.raises(Refused, match=r"held by someone else \('admin: PSU swap ticket 4411'\)"):
            call()
    assert local.node("n1") == held and not held.ours and held.service is Service.DRAINED
    # An administrator taking over one of our drains makes it theirs.
    local.cordon("n2", "gpuwarden: xid 79")
    local.admin_drain("n2", "admin: hold for RMA")
    with pytest.raises(Refused):
        local.resume("n2")
    local.admin_resume("n2")
    assert local.node("n2").service is Service.IN_SERVICE


# -- two agents racing for one spare ---------------------------------------------------------------------------------
def _racer(db: str, log: str, me: str, rounds: int, barrier, out) -> None:
    a = LocalAdapter(Path(log), db=Path(db), timeout_s=60)
    got = []
    for r in range(rounds):
        barrier.wait(60)  # both agents reach for the last spare of domain r<r> at the same moment
        got.append(a.take_spare(f"d{r}", f"{me}-failed-{r}"))
    out.put((me, got))


def test_two_agents_racing_never_take_the_same_spare(tmp_path):
    rounds = 25
    db, seeder = tmp_path / "fleet.db", LocalAdapter(tmp_path / "seed.jsonl", db=tmp_path / "fleet.db")
    for r in range(rounds):  # every domain has one spare left: exactly one agent may have it
        seeder.return_to_pool(f"d{r}-spare", f"d{r}")
    seeder.return_to_pool("pool-a", "big")
    ctx = multiprocessing.get_context("spawn")  # separate interpreters, as two agents on two nodes
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(db), str(tmp_path / f"{me}.jsonl"), me, rounds, barrier, out))
             for me in ("a", "b")]
    results = _race(procs, out)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(rounds):
        won = [results[me][r] for me in ("a", "b") if results[me][r] is not None]
        assert won == [f"d{r}-spare"], (r, results["a"][r], results["b"][r])
    # The scheduler's record agrees: each spare taken for exactly one failed node, by the agent that got it.
    taken = {v.name for v in seeder.nodes() if v.name.endswith("-spare") and v.service is Service.IN_SERVICE}
    assert taken == {f"d{r}-spare" for r in range(rounds)}
    for me in ("a", "b"):
        lines = [json.loads(x) for x in (tmp_path / f"{me}.jsonl").read_text().splitlines()]
        assert [x["spare"] for x in lines] == results[me]


def _race(procs, out) -> dict:
    """Starts the racing processes and returns what each put on `out`; every process is ended whatever happened."""
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()


def _drainer(db: str, me: str, count: int, barrier, out) -> None:
    a = LocalAdapter(Path(db).with_name(f"{me}.jsonl"), db=Path(db), timeout_s=60)
    barrier.wait(60)
    out.put((me, [a.take_spare("big", f"{me}-{i}") for i in range(count)]))


def test_agents_emptying_one_pool_at_once_share_it_without_overlap(tmp_path):
    db = tmp_path / "fleet.db"
    seeder = LocalAdapter(tmp_path / "seed.jsonl", db=db)
    for i in range(30):
        seeder.return_to_pool(f"s{i}", "big")
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_drainer, args=(str(db), me, 15, barrier, out)) for me in ("a", "b", "c")]
    results = _race(procs, out)
    got = [s for r in results.values() for s in r if s is not None]
    assert len(got) == len(set(got)) == 30 and set(got) == {f"s{i}" for i in range(30)}
    assert sum(s is None for r in results.values() for s in r) == 15 and seeder.spares("big") == []
    # Each agent's own actions log has its own calls, once each, in order, though the three shared one database.
    ids = []
    for me in ("a", "b", "c"):
        log = LocalAdapter(tmp_path / f"{me}.jsonl", db=db).actions()
        assert [(e["action"], e["node"], e["spare"]) for e in log] == [
            ("take_spare", f"{me}-{i}", spare) for i, spare in enumerate(results[me])]
        ids += [e["id"] for e in log]
    assert len(set(ids)) == 45


# -- a database held by another process, or not a database at all ----------------------------------------------------
def test_a_database_held_by_another_process_is_transient(tmp_path):
    a = LocalAdapter(tmp_path / "actions.jsonl", db=tmp_path / "s.db", timeout_s=0.2)
    a.publish_domain("n1", "r0")
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another agent in the middle of its own transaction
        with pytest.raises(Transient, match=r"s\.db: held by another process for more than 0.2 s"):
            a.cordon("n1", "gpuwarden: xid 79")
        assert [v.name for v in a.nodes()] == ["n1"]  # reading goes on
        holder.execute("COMMIT")
    finally:
        holder.close()
    a.cordon("n1", "gpuwarden: xid 79")  # the retry succeeds once it is free
    assert a.node("n1").service is Service.CORDONED


@pytest.mark.parametrize("content", [b"this is not a database\n" * 100, b"SQLite format 3\x00" + b"\xff" * 4080])
def test_a_corrupt_database_is_an_error_naming_the_file(tmp_path, content):
    db = tmp_path / "scheduler.db"
    db.write_bytes(content)
    a = LocalAdapter(tmp_path / "actions.jsonl", db=db)
    for call in (a.nodes, lambda: a.cordon("n1", "gpuwarden: x"), lambda: a.take_spare("r0", "n1")):
        with pytest.raises(LocalDatabaseError, match=f"{db}: cannot be used as the local scheduler's database") as e:
            call()
        assert isinstance(e.value, Refused) and "move it aside" in str(e.value)
    assert db.read_bytes() == content  # left as it was, for a person to look at


def test_a_database_deleted_under_a_running_adapter_starts_again_empty(local):
    local.cordon("n1", "gpuwarden: xid 79")
    local.db.unlink()
    assert list(local.nodes()) == []
    local.cordon("n2", "gpuwarden: xid 79")
    assert [v.name for v in local.nodes()] == ["n2"]


def test_another_programs_database_is_refused_by_name(tmp_path):
    Store(tmp_path / "state.db").close()  # the agent's own state database, pointed at by mistake
    a = LocalAdapter(tmp_path / "actions.jsonl", db=tmp_path / "state.db")
    with pytest.raises(LocalDatabaseError, match=r"state\.db: not a gpuwarden local scheduler database "
                                                 r"\(another program's SQLite database\)"):
        a.nodes()


def test_a_database_path_that_cannot_be_opened_is_an_error_naming_it(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(LocalDatabaseError, match="adir: cannot be used"):
        LocalAdapter(tmp_path / "actions.jsonl", db=tmp_path / "adir").nodes()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(LocalDatabaseError, match="afile/sub/s.db: cannot create its folder: Not a directory"):
        LocalAdapter(tmp_path / "actions.jsonl", db=tmp_path / "afile" / "sub" / "s.db").nodes()


@pytest.mark.parametrize("bad", ["", " n1", "n\x001", "x" * 256, None, 7])
def test_names_that_are_not_names_are_refused(local, bad):
    with pytest.raises(Refused, match="name must be"):
        local.cordon(bad, "gpuwarden: x")


def test_a_reason_is_kept_one_line_bounded_and_marked(local):
    local.cordon("n1", "xid 79\nGPU3\x1b[31m" + "y" * 5000)
    reason = local.node("n1").reason
    assert reason.startswith("gpuwarden: xid 79 GPU3 [31my") and len(reason) == 1024 and "\n" not in reason
    with pytest.raises(Refused, match="reason must be text"):
        local.drain("n1", None)


def test_a_timeout_out_of_range_is_refused(tmp_path):
    for bad in (0, -1, float("nan"), 601):
        with pytest.raises(ValueError, match="timeout_s"):
            LocalAdapter(tmp_path / "a.jsonl", timeout_s=bad)


# -- the policy over the local scheduler's view ------------------------------------------------------------------------
def test_the_breaker_and_the_spare_plan_read_the_local_schedulers_view(local, clock):
    seed_rack(local, "r0")
    seed_rack(local, "r1")
    local.admin_drain("r0-n15", "admin: reseat")  # not ours: never counted
    for i in range(4):
        local.quarantine(f"r0-n{i}", "gpuwarden: xid 79")
        clock.now += 10
    fleet, policy = local.nodes(), BreakerPolicy(cluster_share=0.2)  # 7 of these 36 nodes
    held = judge(fleet, "r0-n4", "r0", clock.now, policy)
    assert not held.allow and held.domain == (5, 18) and held.cluster == (5, 36)
    assert judge(fleet, "r1-n0", "r1", clock.now, policy).allow
    assert judge(fleet, "r0-n4", "r0", clock.now + 600, policy).allow  # the window has passed
    assert not judge(fleet, "r1-n0", "r1", clock.now, BreakerPolicy()).allow  # 10 %: 3 of 36
    # The spares: the plan's first candidate is what the scheduler hands out, then the slice must move.
    plan = plan_swap(fleet, "r0-n0", SparePolicy())
    assert plan.candidates == ("r0-s0", "r0-s1") and local.take_spare("r0", "r0-n0") == plan.candidates[0]
    assert local.take_spare("r0", "r0-n1") == "r0-s1"
    plan = plan_swap(local.nodes(), "r0-n2", SparePolicy())
    assert plan.slice_must_move and plan.hosts == ()  # r1's nodes are busy as far as anyone knows
    for i in range(16):
        local.set_jobs(f"r1-n{i}", 0)
    assert plan_swap(local.nodes(), "r0-n2", SparePolicy()).hosts == ("r1",)
    # Repaired: back to the pool while it is short, else to service.
    assert wants_back_in_pool(local.nodes(), "r0-n0", SparePolicy())
    local.return_to_pool("r0-n0", "r0")
    assert not wants_back_in_pool(local.nodes(), "r0-n1", SparePolicy(per_domain=1))


# -- the actions log holds each change once, whatever a crash cuts short ---------------------------------------------
def _drain_and_die(log: str, where: str) -> None:
    """Drains n1 and is killed (SIGKILL) at `where`: "commit" (the change committed, its line not yet written),
    "written" (the line written, its row in the database not yet forgotten). A process of its own (spawned)."""
    import os
    import signal

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "commit":
        LocalAdapter._flush = die  # type: ignore[method-assign]
    else:
        real = os.fsync
        os.fsync = lambda fd: (real(fd), die())  # the line on disk, then the end
    LocalAdapter(Path(log)).drain("n1", "xid 79")


def _crash_in(tmp_path: Path, where: str) -> None:
    import signal

    proc = multiprocessing.get_context("spawn").Process(target=_drain_and_die,
                                                        args=(str(tmp_path / "actions.jsonl"), where))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL, proc.exitcode


@pytest.mark.parametrize("where", ["commit", "written"])
def test_a_crash_during_a_call_neither_loses_nor_repeats_its_line(tmp_path, where):
    a = LocalAdapter(tmp_path / "actions.jsonl")
    a.cordon("n0", "xid 13")
    _crash_in(tmp_path, where)
    assert a.node("n1").service is Service.DRAINED  # the change stands
    on_disk = [json.loads(line) for line in (tmp_path / "actions.jsonl").read_text().splitlines()]
    assert [e["node"] for e in on_disk] == (["n0"] if where == "commit" else ["n0", "n1"])
    a.resume("n0")  # the next call writes what the crash left in the database, once, before its own line
    log = a.actions()
    assert [(e["action"], e["node"], e["changed"]) for e in log] == [
        ("cordon", "n0", True), ("drain", "n1", True), ("resume", "n0", True)]
    ids = [e["id"] for e in log]
    assert len(set(ids)) == 3 and [int(i.split(":")[1]) for i in ids] == sorted(int(i.split(":")[1]) for i in ids)
    assert LocalAdapter(tmp_path / "actions.jsonl").actions() == log  # read again: nothing more written
    with sqlite3.connect(a.db) as db:
        assert db.execute("SELECT count(*) FROM actions_outbox").fetchone()[0] == 0


def test_a_torn_last_line_stays_apart_and_a_log_that_cannot_be_written_waits(tmp_path, clock):
    a = LocalAdapter(tmp_path / "actions.jsonl", clock=clock)
    a.drain("n1", "xid 79")
    with open(a.path, "a") as f:
        f.write('{"action": "dr')  # a line a crash left torn
    a.resume("n1")
    lines = a.path.read_text().splitlines()
    assert lines[1] == '{"action": "dr' and json.loads(lines[2])["action"] == "resume"
    assert [e["action"] for e in a.actions()] == ["drain", "resume"]
    # The log cannot be written (a folder stands where it should be): the calls act, their lines wait.
    blocked = LocalAdapter(tmp_path / "blocked" / "actions.jsonl", db=a.db, clock=clock)
    blocked.path.mkdir(parents=True)
    blocked.cordon("n2", "xid 13")
    blocked.publish_domain("n2", "rack1")
    assert blocked.node("n2").service is Service.CORDONED and blocked.node("n2").domain == "rack1"
    with sqlite3.connect(a.db) as db:
        assert db.execute("SELECT count(*) FROM actions_outbox").fetchone()[0] == 2
    blocked.path.rmdir()
    assert [(e["action"], e["node"]) for e in blocked.actions()] == [("cordon", "n2"), ("publish_domain", "n2")]
    assert [e["action"] for e in a.actions()] == ["drain", "resume"]  # each log gets its own lines only


def test_lines_of_a_database_made_again_are_told_from_the_old_ones(tmp_path):
    a = LocalAdapter(tmp_path / "actions.jsonl")
    a.drain("n1", "xid 79")
    a.db.unlink()  # moved aside: the next call starts an empty one, whose row ids begin again
    b = LocalAdapter(tmp_path / "actions.jsonl")
    b.drain("n1", "xid 79")
    log = b.actions()
    assert [(e["action"], e["changed"]) for e in log] == [("drain", True), ("drain", True)]
    assert log[0]["id"].split(":")[0] != log[1]["id"].split(":")[0]
