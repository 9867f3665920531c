"""The state store under edits and damage, through the real `gpuwarden run` on a copy of a recorded node and a
restart: a store whose tables were edited is set aside (named in the log and in `status`) and the kernel log read
again; a kernel-log cursor that was edited, rolled back or is ahead of the kernel neither loses nor doubles an XID
(records are counted once by their identity, boot id + seq); a store truncated under the running daemon shows on
/metrics at the next scrape, as `status` sees it, and is set aside and written again from memory. Stores that
earlier versions wrote open as they are."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, append_kmsg, end_processes, wait_for
from gpuwarden.agent.core.kernel_log import parse_kmsg_text
from gpuwarden.agent.sources.kmsg import KernelLog, KmsgFollower
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.sources.kmsg_scan import Interest
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.store_errors import StoreError

XID13 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1"
XID31 = "3,{seq},{usec},-;NVRM: Xid (PCI:000a:01:00): 31, pid=7, name=python3, MMU Fault"
GPU13, GPU31 = "0009:01:00.0", "000a:01:00.0"
# Generous: a daemon start imports the whole agent, and the machine the suite runs on is small and shared.
START_S, SEEN_S = 90.0, 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """`gpuwarden run` in its own process on a recorded node (`wrap`: a command it, `status` and the store's reads
    run under, e.g. nsenter into a mount namespace), its JSON log appended to `log`."""

    def __init__(self, root: Path, state: Path, log: Path, wrap: tuple[str, ...] = ()):
        self.root, self.state, self.log, self.wrap = root, state, log, wrap
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> "Agent":
        self.port = free_port()
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([*self.wrap, sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root",
                                          str(self.root), "--state-dir", str(self.state), "--listen",
                                          f"127.0.0.1:{self.port}", "--log-format", "json"],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        wait_for(lambda: self.proc.poll() is not None or self._answers(), timeout_s=START_S, what="the daemon up")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return self

    def _answers(self) -> bool:
        try:
            self.metrics()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                assert self.proc.wait(60) == 0, self.log.read_text()[-3000:]
            finally:
                end_processes(self.proc)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def sample(self, name: str, labels: str = "") -> float | None:
        """The value of `name{labels}` on the page (labels as the page writes them), None when absent."""
        head = f"{name}{{{labels}}} " if labels else f"{name} "
        for line in self.metrics().splitlines():
            if line.startswith(head):
                return float(line.rsplit(" ", 1)[1])
        return None

    def status(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.wrap, sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir",
                               str(self.state), *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)

    def logged(self, event: str) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("event") == event:
                out.append(doc)
        return out

    def count(self, pci: str, xid: int) -> int | None:
        """The incident's kernel-log count as the store holds it now (None: no such incident, or not readable), read
        where the daemon runs (SQLite resolves a path through /proc/PID/root to this process's own view)."""
        if not self.wrap:
            return stored_count(self.state / "state.db", pci, xid)
        proc = subprocess.run([*self.wrap, sys.executable, "-c", "import sys; from test_store_damage import "
                               "stored_count; print(stored_count(sys.argv[1], sys.argv[2], int(sys.argv[3])))",
                               str(self.state / "state.db"), pci, str(xid)], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))})
        assert proc.returncode == 0, proc.stderr
        return None if proc.stdout.strip() == "None" else int(proc.stdout)


def stored_count(db: Path | str, pci: str, xid: int) -> int | None:
    try:
        store = Store(Path(db), readonly=True)  # another process's view, as `status` reads it
        try:
            rec = store.check("xid")
        finally:
            store.close()
    except StoreError:
        return None
    inc = rec.state.get("incidents", {}).get(f"{pci}|{xid}") if rec else None
    return inc.get("kmsg_count") if inc else None


def last_seq(root: Path) -> int:
    return max(r.seq for r in parse_kmsg_text((root / "kmsg").read_text(), "kmsg")[0] if r.seq is not None)


@pytest.fixture
def agent(scenario_copy, tmp_path):
    made: list[Agent] = []

    def make() -> Agent:
        a = Agent(scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", tmp_path / "agent.log")
        made.append(a)
        return a

    yield make
    for a in made:
        end_processes(a.proc)


def three_xids_written(a: Agent) -> None:
    a.start()
    append_kmsg(a.root, XID13, 3)
    wait_for(lambda: a.count(GPU13, 13) == 3, timeout_s=SEEN_S, what="3 XIDs written")
    a.stop()


def counted_once_more(a: Agent, expected: int) -> None:
    """The XID 31 line, appended last, is in the store: everything before it has been read, and the XID 13 count is
    `expected` (none lost, none doubled)."""
    append_kmsg(a.root, XID31)
    wait_for(lambda: a.count(GPU31, 31) == 1, timeout_s=SEEN_S, what="the last line counted")
    assert a.count(GPU13, 13) == expected
    assert a.sample("gpuwarden_xid_events", f'pci="{GPU13}",xid="13"') == expected


def execute(db: Path, *statements: str) -> None:
    conn = sqlite3.connect(db)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


# -- a store whose tables were edited --------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, left", [
    ("DROP TABLE checks", "checks"),
    ("CREATE TABLE notes (text TEXT)", "notes"),
    ("UPDATE meta SET value = '99' WHERE key = 'schema'", "version '99'"),
    ("ALTER TABLE intents DROP COLUMN outcome", "intents.outcome"),
])
def test_a_store_whose_tables_were_edited_is_set_aside_and_the_kernel_log_read_again(agent, edit, left):
    a = agent()
    three_xids_written(a)
    db = a.state / "state.db"
    execute(db, edit)
    a.start()
    counted_once_more(a, 3)  # the incidents, gone with the table, counted again from the kernel log; once
    aside = [p for p in a.state.glob("state.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(aside) == 1, list(a.state.iterdir())
    said = [e["detail"] for e in a.logged("state store set aside")]
    assert len(said) == 1 and aside[0].name in said[0] and left in said[0], said
    kept = sqlite3.connect(f"{aside[0].as_uri()}?mode=ro", uri=True)  # the damaged file kept as it was
    try:
        tables = {r[0] for r in kept.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        kept.close()
    assert ("checks" not in tables) if edit.startswith("DROP TABLE") else ("checks" in tables)
    shown = a.status()
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"set aside as {aside[0].name}" in shown.stdout and left in shown.stdout, shown.stdout
    a.stop()


# -- an edited kernel-log cursor ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["rolled-back", "ahead-of-the-kernel", "forward"])
def test_an_edited_kernel_log_cursor_neither_loses_nor_doubles_a_record(agent, where):
    a = agent()
    before = last_seq(a.root)
    three_xids_written(a)
    append_kmsg(a.root, XID13, 2)  # logged while the daemon was down
    seq = {"rolled-back": before, "ahead-of-the-kernel": 10**9, "forward": last_seq(a.root)}[where]
    db = a.state / "state.db"
    (cursor,) = sqlite3.connect(db).execute("SELECT value FROM meta WHERE key = 'kmsg_cursor'").fetchone()
    execute(db, f"UPDATE meta SET value = '{json.dumps({**json.loads(cursor), 'seq': seq})}' "
                "WHERE key = 'kmsg_cursor'")
    a.start()
    counted_once_more(a, 5)
    said = a.logged("kernel-log cursor disagrees with the records counted; resuming after the records counted (a "
                    "record is counted once, by boot id and seq)")
    assert [(e["cursor_seq"], e["counted_seq"]) for e in said] == [(seq, before + 3)]
    a.stop()


def test_a_follower_whose_cursor_is_ahead_of_the_kernel_reads_the_records_that_come_next(tmp_path):
    """Where the records counted themselves are ahead (a cursor of the boot past its newest record), the log read
    from its start says so: the follower reads on from the newest record, and what comes next is counted."""
    log = tmp_path / "kmsg"
    log.write_text("".join(f"6,{n},{n * 1000},-;line {n}\n" for n in range(1, 6)))
    follower = KmsgFollower(KernelLog(log, live=False, boot_id="b"), Cursor("b", 10**9), Interest(["Xid"]))
    try:
        assert follower.poll() == []  # every record there is taken as counted: none doubled
        assert follower.ahead == (10**9, 5) and follower.cursor == Cursor("b", 5)
        with open(log, "a") as f:
            f.write("3,6,6000,-;NVRM: Xid (PCI:0009:01:00): 13, pid=1, name=x, Graphics Exception\n")
        assert [r.seq for r in follower.poll()] == [6]
    finally:
        follower.close()


# -- stores of earlier versions -------------------------------------------------------------------------------------
V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE node (id INTEGER PRIMARY KEY CHECK (id = 1), record TEXT NOT NULL);
CREATE TABLE checks (name TEXT PRIMARY KEY, state TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
    findings TEXT NOT NULL, updated REAL NOT NULL, duration_s REAL NOT NULL);
CREATE TABLE transitions (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, frm TEXT NOT NULL, too TEXT NOT NULL,
    reason TEXT NOT NULL, actions TEXT NOT NULL);
CREATE TABLE intents (key TEXT PRIMARY KEY, action TEXT NOT NULL, created REAL NOT NULL, done REAL,
    detail TEXT NOT NULL);
"""
V2 = V1 + "ALTER TABLE intents ADD COLUMN outcome TEXT;\n"
V3 = V2 + """CREATE TABLE check_parts (name TEXT NOT NULL, part TEXT NOT NULL, sub TEXT NOT NULL, ord INTEGER NOT NULL,
    value TEXT NOT NULL, PRIMARY KEY (name, part, sub)) WITHOUT ROWID;
"""


@pytest.mark.parametrize("version, schema", [("1", V1), ("2", V2), ("3", V3)])
def test_a_store_an_earlier_version_wrote_opens_as_it_is_and_keeps_its_cursor(tmp_path, version, schema):
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    conn.executescript(schema)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("schema", version),
                                                       ("kmsg_cursor", json.dumps({"boot_id": "b", "seq": 41}))])
    conn.execute("INSERT INTO checks VALUES ('xid', '{\"boot_id\": \"b\", \"incidents\": {}}', 'ok', NULL, '[]', 1.0, "
                 "0.0)")
    conn.commit()
    conn.close()
    store = Store(db, lock=True)
    try:
        assert store.set_aside is None and not list(tmp_path.glob("state.db.corrupt-*"))
        assert store.counted() == ("b", 41)  # what the cursor said was read is what was counted
        assert store.check("xid") == CheckRecord("xid", {"boot_id": "b", "incidents": {}},
                                                 store.check("xid").status, None, (), 1.0, 0.0)
        assert store.meta("schema") == "4"
    finally:
        store.close()


def test_a_store_an_older_daemon_opened_since_is_counted_from_its_cursor(tmp_path):
    """A version-4 file opened by a version-3 daemon (a downgrade and back) holds a stale row of the records counted:
    the cursor that daemon moved says what was counted."""
    db = tmp_path / "state.db"
    store = Store(db)
    store.commit(meta={"kmsg_cursor": {"boot_id": "b", "seq": 10}})
    store.close()
    execute(db, "UPDATE meta SET value = '{\"boot_id\": \"b\", \"seq\": 25}' WHERE key = 'kmsg_cursor'",
            "UPDATE meta SET value = '3' WHERE key = 'schema'")
    store = Store(db)
    try:
        assert store.set_aside is None and store.counted() == ("b", 25)
    finally:
        store.close()


# -- a store truncated under the running daemon ---------------------------------------------------------------------
def test_a_store_truncated_while_running_shows_at_the_next_scrape_and_is_written_again(agent):
    a = agent().start()
    append_kmsg(a.root, XID13, 3)
    wait_for(lambda: a.count(GPU13, 13) == 3, timeout_s=SEEN_S, what="3 XIDs written")
    db = a.state / "state.db"
    os.truncate(db, 0)
    ok = a.sample("gpuwarden_store_ok")
    # 0 at the first scrape, unless a write came between the truncation and the scrape: it has set the file aside
    # then (what is being tested below), and the page says what the file is now.
    assert ok == 0.0 or list(a.state.glob("state.db.corrupt-*")), ok
    aside = wait_for(lambda: [p for p in a.state.glob("state.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))],
                     timeout_s=SEEN_S, what="the truncated file set aside")
    # The file is renamed before the line that names it is written: wait for the line, not only the file.
    said = wait_for(lambda: [e["detail"] for e in a.logged("state store set aside")],
                    timeout_s=SEEN_S, what="the set-aside logged")
    # "truncated to 0 bytes", or, where SQLite's checkpoint wrote past the file's start before the writer looked, the
    # hole of zeros it left: a truncation either way, named as one.
    assert any(aside[0].name in d and ("truncated to 0 bytes" in d or "its first bytes are zeros" in d)
               for d in said), said
    wait_for(lambda: a.count(GPU13, 13) == 3, timeout_s=SEEN_S, what="the counts written again from memory")
    wait_for(lambda: a.sample("gpuwarden_store_ok") == 1.0, timeout_s=SEEN_S, what="store_ok back to 1")
    shown = a.status()
    assert shown.returncode == 0 and f"set aside as {aside[0].name}" in shown.stdout, shown.stdout + shown.stderr
    counted_once_more(a, 3)
    a.stop()


def test_status_says_a_store_truncated_under_the_daemon_is_failing_until_it_is_set_aside(agent):
    """`status` asks the running daemon, which looks at the file as it answers: a truncation is said (exit 2, what
    happened to the file) before the writer's next turn, and `status` is back to 0 once the file is set aside."""
    a = agent().start()
    append_kmsg(a.root, XID13)
    wait_for(lambda: a.count(GPU13, 13) == 1, timeout_s=SEEN_S, what="the first XID written")
    os.truncate(a.state / "state.db", 0)
    shown = a.status("--json")
    writes = json.loads(shown.stdout)["store_writes"]
    if writes["ok"]:  # a write came first: the file is set aside already, and the page and status say so alike
        assert list(a.state.glob("state.db.corrupt-*")), shown.stdout
    else:
        assert shown.returncode == 2 and writes["since_utc"], writes
        assert "truncated to 0 bytes" in writes["error"] or "its first bytes are zeros" in writes["error"], writes
    wait_for(lambda: list(a.state.glob("state.db.corrupt-*")), timeout_s=SEEN_S, what="the file set aside")
    wait_for(lambda: a.status().returncode == 0, timeout_s=SEEN_S, what="status back to 0")
    assert a.sample("gpuwarden_store_ok") == 1.0 and a.count(GPU13, 13) == 1
    a.stop()


def test_a_store_cut_and_written_past_its_start_is_said_truncated(tmp_path):
    """The race the running daemon's tests meet: the file cut to 0 bytes, then SQLite's checkpoint writes a page
    past its start before the writer looks. The file is as long as before, its start a hole of zeros: a truncation,
    said as one, never "overwritten"."""
    db = tmp_path / "state.db"
    store = Store(db)
    try:
        store.commit(meta={"kmsg_cursor": {"boot_id": "b", "seq": 10}})
        size = db.stat().st_size
        assert store.file_fault() is None
        os.truncate(db, 0)
        with open(db, "r+b") as f:  # a page written where it was, past the start: the bytes before it a hole
            f.seek(size - 100)
            f.write(b"\x01" * 100)
        assert db.stat().st_size == size
        fault = store.file_fault()
        assert fault is not None and "truncated" in fault and "its first bytes are zeros" in fault, fault
        with open(db, "r+b") as f:  # a header someone wrote over: overwritten, as before
            f.write(b"not a database!!")
        assert "overwritten" in store.file_fault()
    finally:
        store.close()
