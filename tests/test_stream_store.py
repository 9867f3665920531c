"""The state store writes what changed: a check's incidents and findings are parts, each written when it moved; a
restart reads back exactly what was written; the WAL stays bounded however many commits are made."""
from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import JOURNAL_LIMIT_BYTES, Store


def incident(pci: str, xid: int, count: int) -> dict:
    return {"pci": pci, "xid": xid, "count": count, "kmsg_count": count, "nvml_count": 0, "first_at": 1.0,
            "last_at": 1.0 + count, "first_seq": 10, "last_seq": 10 + count, "pids": ["4242"], "processes": ["python3"],
            "first_message": f"NVRM: Xid (PCI:{pci}): {xid}, pid=4242, name=python3", "last_detail": "pid=4242"}


def finding(pci: str, xid: int, count: int) -> Finding:
    return Finding("xid", str(xid), Entity("gpu", f"GPU-{pci}", None, pci), Status.FAIL,
                   f"XID {xid} on {pci}: {count} event(s)", Action.DRAIN, {"count": count, "pci": pci})


PAIRS = [(f"000{g}:01:00.0", x) for x in (13, 31, 43, 48, 61, 62, 63, 64, 68, 79) for g in range(4)]  # 40


def record(counts: dict[tuple[str, int], int]) -> CheckRecord:
    incidents = {f"{p}|{x}": incident(p, x, n) for (p, x), n in counts.items()}
    return CheckRecord("xid", {"boot_id": "b", "incidents": incidents, "uuids": {"0000:01:00.0": "GPU-a"}},
                       Status.FAIL, None, tuple(finding(p, x, n) for (p, x), n in counts.items()), 5.0, 0.1)


def changes(store: Store, **commit) -> int:
    """Rows the commit inserted, replaced or deleted."""
    before = store._db.total_changes
    store.commit(**commit)
    return store._db.total_changes - before


def reread(path: Path, name: str = "xid") -> CheckRecord:
    store = Store(path)
    try:
        return store.check(name)
    finally:
        store.close()


def same(a: CheckRecord, b: CheckRecord) -> None:
    assert a.state == b.state and a.findings == b.findings  # findings in their order
    assert list(a.state["incidents"]) == list(b.state["incidents"])  # incidents in the order they came
    assert (a.status, a.error, a.updated, a.duration_s) == (b.status, b.error, b.updated, b.duration_s)


def test_a_commit_writes_what_changed_and_a_restart_reads_back_the_same(tmp_path):
    path = tmp_path / "state.db"
    counts = {pair: 1 for pair in PAIRS}
    store = Store(path)
    try:
        first = changes(store, checks=[record(counts)])
        assert first >= 1 + 2 * len(PAIRS)  # the row, every incident and every finding
        counts[PAIRS[17]] += 1
        rec = record(counts)
        # The check's row, the one incident and the one finding that moved: not the 40 others.
        assert changes(store, checks=[rec]) == 3
        assert changes(store, checks=[rec]) == 1  # nothing moved: the row alone (status, time)
        same(store.check("xid"), rec)
    finally:
        store.close()
    same(reread(path), rec)


def test_after_a_restart_the_first_commit_writes_only_what_changed(tmp_path):
    path = tmp_path / "state.db"
    counts = {pair: 1 for pair in PAIRS}
    store = Store(path)
    store.commit(checks=[record(counts)])
    store.close()
    store = Store(path)  # reads every check at open (a daemon starts from them)
    try:
        counts[PAIRS[0]] += 1
        assert changes(store, checks=[record(counts)]) == 3
    finally:
        store.close()
    same(reread(path), record(counts))


def test_incidents_that_end_and_come_are_removed_and_added(tmp_path):
    path = tmp_path / "state.db"
    counts = {pair: 1 for pair in PAIRS[:10]}
    store = Store(path)
    try:
        store.commit(checks=[record(counts)])
        del counts[PAIRS[3]]  # expired
        counts[PAIRS[30]] = 2  # new, comes last
        store.commit(checks=[record(counts)])
        # No incident left: the state holds an empty map, and no part is left behind.
        empty = CheckRecord("xid", {"boot_id": "b", "incidents": {}}, Status.OK, None, (), 6.0, 0.1)
        store.commit(checks=[CheckRecord("other", {"ports": {"mlx5_0/1": {"down_since": None}}}, Status.OK, None,
                                         (), 6.0, 0.0)])
    finally:
        store.close()
    same(reread(path), record(counts))
    store = Store(path)
    try:
        store.commit(checks=[empty])
        (parts,) = store._db.execute("SELECT count(*) FROM check_parts WHERE name = 'xid'").fetchone()
        assert parts == 0
    finally:
        store.close()
    assert reread(path).state == {"boot_id": "b", "incidents": {}}
    assert reread(path, "other").state == {"ports": {"mlx5_0/1": {"down_since": None}}}


def test_a_row_written_whole_by_an_earlier_version_reads_the_same_and_is_rewritten_in_parts(tmp_path):
    path = tmp_path / "state.db"
    rec = record({pair: 2 for pair in PAIRS[:5]})
    Store(path).close()
    with sqlite3.connect(path) as db:  # the layout of schema 2: state and findings whole in the checks row
        db.execute("INSERT INTO checks VALUES (?, ?, ?, ?, ?, ?, ?)",
                   ("xid", json.dumps(rec.state), rec.status.value, rec.error,
                    json.dumps([f.to_dict() for f in rec.findings]), rec.updated, rec.duration_s))
    same(reread(path), rec)
    counts = {pair: 2 for pair in PAIRS[:5]}
    counts[PAIRS[1]] = 3
    store = Store(path)
    try:
        store.commit(checks=[record(counts)])
    finally:
        store.close()
    same(reread(path), record(counts))
    with sqlite3.connect(path) as db:
        (findings,) = db.execute("SELECT findings FROM checks WHERE name = 'xid'").fetchone()
    assert findings == "[]"  # no finding twice: the whole list went, the parts hold them


def test_a_commit_that_fails_leaves_the_state_before_it_and_the_next_one_writes_it_all(tmp_path):
    path = tmp_path / "state.db"
    counts = {pair: 1 for pair in PAIRS[:8]}
    store = Store(path)
    try:
        store.commit(checks=[record(counts)])
        bad = record(counts)
        bad.state["incidents"][f"{PAIRS[0][0]}|{PAIRS[0][1]}"] = {"not json": {1, 2}}  # fails inside the transaction
        with pytest.raises(TypeError):
            store.commit(checks=[bad])
        same(store.check("xid"), record(counts))
        counts[PAIRS[2]] = 5
        store.commit(checks=[record(counts)])
    finally:
        store.close()
    same(reread(path), record(counts))


def test_the_wal_stays_bounded_over_many_commits(tmp_path):
    path = tmp_path / "state.db"
    wal = Path(f"{path}-wal")
    counts = {pair: 1 for pair in PAIRS}
    store = Store(path)
    largest = 0
    try:
        for i in range(3000):
            counts[PAIRS[i % len(PAIRS)]] += 1
            store.commit(checks=[record(counts)], meta={"kmsg_cursor": {"boot_id": "b", "seq": i}})
            largest = max(largest, wal.stat().st_size if wal.exists() else 0)
    finally:
        store.close()
    # Checkpointed every 256 pages and cut back to the limit: SQLite's defaults leave 4 MB and more.
    assert 0 < largest <= 2 * JOURNAL_LIMIT_BYTES, largest
    assert os.path.getsize(path) < 1 << 20
    same(reread(path), record(counts))
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_random_commits_failures_and_restarts_read_back_exactly_what_was_last_written(tmp_path):
    """A check's record as the daemon makes it (entries and findings not touched are the same objects from one
    commit to the next) through random runs of entries that come, change, end and come back, a second split
    value, a value whose entries stop being objects, findings that grow and shrink, commits that fail inside the
    transaction, and restarts: what is read back is always the last record written, in its order."""
    import random
    rng = random.Random(13)
    path = tmp_path / "state.db"
    store = Store(path)
    incidents: dict = {}
    ports: dict = {}
    findings: list = []
    written = None
    try:
        for step in range(400):
            incidents, ports, findings = dict(incidents), dict(ports), list(findings)
            for _ in range(rng.randint(0, 3)):
                pci, xid = rng.choice(PAIRS)
                key = f"{pci}|{xid}"
                what = rng.random()
                if what < 0.15:
                    incidents.pop(key, None)
                else:
                    incidents[key] = incident(pci, xid, incidents.get(key, {}).get("count", 0) + 1)
                    if rng.random() < 0.5 and incidents:
                        i = rng.randrange(len(findings) + 1)
                        findings[i:i + 1] = [finding(pci, xid, incidents[key]["count"])]
            if rng.random() < 0.2 and findings:
                del findings[rng.randrange(len(findings)):]  # the findings shrink
            if rng.random() < 0.2:
                port = f"mlx5_{rng.randrange(4)}/1"
                if rng.random() < 0.8:
                    ports[port] = {"down_s": rng.random()}
                else:
                    ports.pop(port, None)
            shaped = ports if rng.random() < 0.9 else {k: 1 for k in ports}  # entries that are not objects
            rec = CheckRecord("xid", {"boot_id": "b", "incidents": incidents, "ports": shaped,
                                      "uuids": {"0000:01:00.0": "GPU-a"}}, Status.FAIL, None, tuple(findings),
                              float(step), 0.1)
            if rng.random() < 0.08:
                bad = CheckRecord("xid", {**rec.state, "incidents": {**incidents, "bad": {"not json": {1}}}},
                                  Status.FAIL, None, rec.findings, float(step), 0.1)
                with pytest.raises(TypeError):
                    store.commit(checks=[bad])
            else:
                store.commit(checks=[rec])
                written = rec
            if written is not None and rng.random() < 0.1:
                store.close()  # a restart: what the new store knows comes from what it reads
                store = Store(path)
                store.checks()
            if written is not None and step % 20 == 0:
                same(reread(path), written)
    finally:
        store.close()
    same(reread(path), written)
    assert list(reread(path).state["ports"]) == list(written.state["ports"])
