"""`gpuwarden status` shows times an operator reads: ISO 8601 UTC to the second with the age, in the table; the JSON
keeps its epoch numbers (a contract) and adds the ISO form beside each."""
from __future__ import annotations

import json
import re
import time

import pytest
from gpuwarden.agent.cli import main as cli
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.render import age, iso_utc, when
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import NodeRecord, NodeState, Transition

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def test_iso_utc_is_second_resolution_utc():
    assert iso_utc(1796064216.73) == "2026-11-30T18:43:36Z"
    assert iso_utc(0.0) is None  # "never set", not 1970
    for bad in (None, float("nan"), float("inf"), -5.0, 1e300):
        assert iso_utc(bad) is None


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (12.9, "12s"), (192, "3m12s"), (3600 + 5 * 60 + 7, "1h05m"), (3 * 86400 + 4 * 3600, "3d04h"),
])
def test_age_keeps_the_two_largest_units(seconds, text):
    assert age(seconds) == text


def test_when_says_how_long_ago_and_never_a_negative_age():
    t = 1796064216.0
    assert when(t, t + 192) == "2026-11-30T18:43:36Z (3m12s ago)"
    assert when(t, t - 30) == "2026-11-30T18:43:36Z (30s ahead of this clock)"
    assert when(None, t) == "-"
    assert when(float("inf"), t) == "inf (not a time)"


def _store(tmp_path, now: float) -> None:
    gpu = Entity("gpu", "GPU-d31f83c1-0000-0000-0000-000000000000", 2, "0018:01:00.0")
    finding = Finding("xid", "79", gpu, Status.FAIL, "XID 79", Action.REBOOT)
    since = now - (3 * 3600 + 2 * 60)  # 3h02m ago: the age's minute cannot roll over while the test runs
    store = Store(tmp_path / "state.db")
    try:
        store.commit(checks=[CheckRecord("xid", {}, Status.FAIL, None, (finding,), now - 2 * 86400, 0.01)],
                     node=NodeRecord(NodeState.CORDONED, since, "XID 79 on GPU 2"),
                     transition=Transition(NodeState.HEALTHY, NodeState.CORDONED, "XID 79 on GPU 2", ("cordon",),
                                           since),
                     intents=[("cordon-1", "cordon", {"at": since})])
    finally:
        store.close()


def test_status_table_shows_iso_times_with_their_age(tmp_path, capsys):
    now = time.time()
    _store(tmp_path, now)
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    since = iso_utc(now - (3 * 3600 + 2 * 60))
    assert f"node state: cordoned since {since} (3h02m ago): XID 79 on GPU 2" in out
    assert re.search(r"xid +fail +updated " + ISO.pattern + r" \(2d00h ago\)", out)
    assert f"  {since} (3h02m ago) healthy -> cordoned: XID 79 on GPU 2 ['cordon']" in out
    assert f"  cordon since {since} (3h02m ago)" in out
    # no raw epoch seconds anywhere (ten digits in a row)
    assert not re.search(r"\b\d{10}\b", out), out


def test_status_json_keeps_the_numbers_and_adds_iso(tmp_path, capsys):
    now = time.time()
    _store(tmp_path, now)
    assert cli.main(["status", "--state-dir", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    since = now - (3 * 3600 + 2 * 60)
    node = doc["node"]
    assert node["since"] == pytest.approx(since) and node["since_utc"] == iso_utc(since)
    assert node["state"] == "cordoned" and node["reason"] == "XID 79 on GPU 2"
    (check,) = doc["checks"]
    assert check["updated"] == pytest.approx(now - 2 * 86400) and ISO.fullmatch(check["updated_utc"])
    (t,) = doc["transitions"]
    assert t["at"] == pytest.approx(since) and t["at_utc"] == iso_utc(since) and t["to"] == "cordoned"
    (intent,) = doc["pending_intents"]
    assert intent["action"] == "cordon" and intent["created_utc"] == iso_utc(since)
    assert ISO.fullmatch(doc["now_utc"]) and doc["now"] >= now
