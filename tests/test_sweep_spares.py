"""Nodes in a sweep are never taken as spares mid-sweep. With the local adapter (no scheduler) a sweep may test the
healthy spares, and holds every node it tests in the local scheduler; take_spare passes held nodes over until the
sweep releases them or the hold expires. (On Slurm a spare is a drained node, which no sweep job can run on, and
idle_nodes never offers one: tests/test_sweep_slurm_e2e.py.)"""
from __future__ import annotations

from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core.scheduler import Service
from gpuwarden.agent.fleet.sweep.sweep import idle_nodes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(tmp_path, clock):
    local = LocalAdapter(tmp_path / "actions.jsonl", clock=clock)
    for n in ("n1", "n2", "n3", "n4"):
        local.publish_domain(n, "rackA")
        local.set_jobs(n, 0)
    for spare in ("s1", "s2"):
        local.publish_domain(spare, "rackA")
        local.return_to_pool(spare, "rackA")
    return local


def test_sweep_held_spares_are_not_taken_until_the_sweep_releases_them(tmp_path):
    clock = Clock()
    local = fleet(tmp_path, clock)
    views = local.nodes()
    swept = [v.name for v in idle_nodes(views, include_spares=True)]
    assert swept == ["n1", "n2", "n3", "n4", "s1", "s2"]
    assert [v.name for v in idle_nodes(views)] == ["n1", "n2", "n3", "n4"]  # spares only when asked

    local.hold_for_sweep("sweep-1", ["n1", "n2", "s1"], for_s=600.0)
    assert local.take_spare("rackA", "n3") == "s2"  # s1 is in the sweep: passed over
    local.hold_for_sweep("sweep-1", ["s2"], for_s=600.0)
    assert local.take_spare("rackA", "n4") is None  # every spare held: none taken
    local.release_sweep("sweep-1")
    assert local.take_spare("rackA", "n4") == "s1"
    assert [a["action"] for a in local.actions() if "sweep" in a["action"]] == \
        ["hold_for_sweep", "hold_for_sweep", "release_sweep"]


def test_sweep_hold_expires_by_itself_when_the_sweep_never_releases_it(tmp_path):
    clock = Clock()
    local = fleet(tmp_path, clock)
    local.hold_for_sweep("sweep-crashed", ["s1", "s2"], for_s=600.0)
    assert local.take_spare("rackA", "n1") is None
    clock.now += 601.0
    assert local.take_spare("rackA", "n1") == "s1"
    assert local.node("s1").service is Service.IN_SERVICE


def test_sweep_holds_live_beside_an_older_local_database(tmp_path):
    """A database made before sweep holds existed gains the table in place: the file stays usable."""
    import sqlite3

    clock = Clock()
    fleet(tmp_path, clock)
    db = tmp_path / "local-scheduler.db"
    with sqlite3.connect(db) as c:
        c.execute("DROP TABLE sweep_holds")
    again = LocalAdapter(tmp_path / "actions.jsonl", clock=clock)
    again.hold_for_sweep("sweep-2", ["s1"], for_s=60.0)
    assert again.take_spare("rackA", "n1") == "s2"
