"""The daemon's durable state in SQLite (stdlib): node record and transition history, each passive check's
state and latest findings, the kernel-log cursor, and the journal of remediation intents.

Every observation is written in one transaction (check state + findings + cursor + node record + intents), so a
crash or kill -9 at any point leaves either the state before or the state after it: never an XID counted twice
or lost, never a downtime accumulator behind its cursor. WAL mode: readers (`gpuwarden status`) do not block
the daemon.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .errors import GpuwardenError
from .model import Finding, Status
from .state import NodeRecord, Transition

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS node (id INTEGER PRIMARY KEY CHECK (id = 1), record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checks (
    name TEXT PRIMARY KEY, state TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
    findings TEXT NOT NULL, updated REAL NOT NULL, duration_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, frm TEXT NOT NULL, too TEXT NOT NULL,
    reason TEXT NOT NULL, actions TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS intents (
    key TEXT PRIMARY KEY, action TEXT NOT NULL, created REAL NOT NULL, done REAL, detail TEXT NOT NULL);
"""
SCHEMA_VERSION = "1"


@dataclass
class CheckRecord:
    name: str
    state: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.UNKNOWN
    error: str | None = "not run yet"
    findings: tuple[Finding, ...] = ()
    updated: float = 0.0
    duration_s: float = 0.0


class StoreError(GpuwardenError):
    pass


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one writer at a time; sqlite3 connections are not thread-safe
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed write survives a crash
            self._db.executescript(SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open state database: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- reads ----------------------------------------------------------------------------------------------
    def node(self) -> NodeRecord | None:
        row = self._one("SELECT record FROM node WHERE id = 1")
        return NodeRecord.from_dict(json.loads(row[0])) if row else None

    def meta(self, key: str) -> Any:
        row = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(row[0]) if row and key != "schema" else (row[0] if row else None)

    def check(self, name: str) -> CheckRecord | None:
        row = self._one("SELECT name, state, status, error, findings, updated, duration_s FROM checks WHERE name = ?",
                        (name,))
        return _check_record(row) if row else None

    def checks(self) -> list[CheckRecord]:
        with self._lock:
            rows = self._db.execute("SELECT name, state, status, error, findings, updated, duration_s FROM checks "
                                    "ORDER BY name").fetchall()
        return [_check_record(r) for r in rows]

    def transitions(self, limit: int = 20) -> list[Transition]:
        with self._lock:
            rows = self._db.execute("SELECT at, frm, too, reason, actions FROM transitions ORDER BY id DESC LIMIT ?",
                                    (limit,)).fetchall()
        from .state import NodeState

        return [Transition(NodeState(f), NodeState(t), r, tuple(json.loads(a)), at) for at, f, t, r, a in rows]

    def intents(self, pending_only: bool = False) -> list[dict[str, Any]]:
        sql = "SELECT key, action, created, done, detail FROM intents"
        sql += " WHERE done IS NULL ORDER BY created" if pending_only else " ORDER BY created"
        with self._lock:
            rows = self._db.execute(sql).fetchall()
        return [{"key": k, "action": a, "created": c, "done": d, "detail": json.loads(x)} for k, a, c, d, x in rows]

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    # -- the one write ------------------------------------------------------------------------------------------
    def commit(self, checks: Iterable[CheckRecord] = (), meta: dict[str, Any] | None = None,
               node: NodeRecord | None = None, transition: Transition | None = None,
               intents: Iterable[tuple[str, str, dict[str, Any]]] = ()) -> list[str]:
        """Write everything one observation changed, atomically. Intents are (key, action, detail); a key that
        exists already is not written again (idempotency). Returns the keys newly written."""
        new_keys: list[str] = []
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for c in checks:
                    self._db.execute(
                        "INSERT OR REPLACE INTO checks VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (c.name, json.dumps(c.state), c.status.value, c.error,
                         json.dumps([f.to_dict() for f in c.findings]), c.updated, c.duration_s))
                for key, value in (meta or {}).items():
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
                if node is not None:
                    self._db.execute("INSERT OR REPLACE INTO node VALUES (1, ?)", (json.dumps(node.to_dict()),))
                if transition is not None:
                    self._db.execute("INSERT INTO transitions (at, frm, too, reason, actions) VALUES (?, ?, ?, ?, ?)",
                                     (transition.at, transition.frm.value, transition.to.value, transition.reason,
                                      json.dumps(list(transition.actions))))
                for key, action, detail in intents:
                    cur = self._db.execute("INSERT OR IGNORE INTO intents VALUES (?, ?, ?, NULL, ?)",
                                           (key, action, detail.get("at", 0.0), json.dumps(detail)))
                    if cur.rowcount:
                        new_keys.append(key)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._db.execute("ROLLBACK")
                raise StoreError(f"{self.path}: write failed: {exc}") from None
        return new_keys

    def mark_done(self, key: str, at: float) -> None:
        with self._lock:
            self._db.execute("UPDATE intents SET done = ? WHERE key = ? AND done IS NULL", (at, key))


def _check_record(row: tuple) -> CheckRecord:
    name, state, status, error, findings, updated, duration = row
    return CheckRecord(name, json.loads(state), Status(status), error,
                       tuple(Finding.from_dict(f) for f in json.loads(findings)), updated, duration)
