import sqlite3

from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import NodeRecord, NodeState, Transition

F = Finding("xid", "79", Entity("gpu", "GPU-1", 2, "0018:01:00.0"), Status.FAIL, "off the bus", Action.REBOOT,
            {"count": 1})


def test_one_commit_writes_everything_and_intents_are_idempotent(tmp_path):
    store = Store(tmp_path / "state.db")
    rec = CheckRecord("xid", {"incidents": {"a": 1}}, Status.FAIL, None, (F,), 10.0, 0.01)
    t = Transition(NodeState.HEALTHY, NodeState.CORDONED, "xid", ("cordon",), 10.0)
    node = NodeRecord(NodeState.CORDONED, 10.0, "xid")
    keys = store.commit([rec], {"kmsg_cursor": {"boot_id": "b", "seq": 42}}, node, t, [("k1", "cordon", {"at": 10.0})])
    assert keys == ["k1"]
    assert store.commit((), None, None, None, [("k1", "cordon", {"at": 10.0})]) == []  # same key: not again
    store.close()
    again = Store(tmp_path / "state.db")  # what a restarted daemon reads
    assert again.check("xid") == rec
    assert again.meta("kmsg_cursor") == {"boot_id": "b", "seq": 42}
    assert again.node() == node
    assert [x.to for x in again.transitions()] == [NodeState.CORDONED]
    assert [i["key"] for i in again.intents(pending_only=True)] == ["k1"]
    again.mark_done("k1", 11.0)
    assert again.intents(pending_only=True) == []


def test_a_failed_commit_leaves_the_previous_state(tmp_path):
    store = Store(tmp_path / "state.db")
    store.commit([CheckRecord("a", {"n": 1}, Status.OK, None, (), 1.0, 0.0)])
    bad = CheckRecord("a", {"n": 2}, Status.OK, None, (), 2.0, 0.0)
    bad.state = {"n": object()}  # not JSON: the write fails before anything is committed
    try:
        store.commit([bad], {"kmsg_cursor": {"seq": 99}})
    except TypeError:
        pass
    assert store.check("a").state == {"n": 1} and store.meta("kmsg_cursor") is None


def test_wal_mode(tmp_path):
    Store(tmp_path / "state.db").close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
