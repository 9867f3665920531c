"""The local scheduler's SQLite file: its schema (made, checked and extended in place), one connection and one
transaction per call, and SQLite's errors made the adapter contract's (`Transient` for a file held by another process,
`LocalDatabaseError` for one that is not a usable database). A base of LocalAdapter (agent/act/adapters/local.py)."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Callable, Sequence

from gpuwarden.agent.core.scheduler import NodeView, Refused, Service, Transient
from gpuwarden.agent.core.sqlite_files import schema_version, write_transaction

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE gpuwarden_local_scheduler (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (
    name TEXT PRIMARY KEY,
    hold TEXT NOT NULL DEFAULT 'none' CHECK (hold IN ('none', 'cordon', 'drain')),
    reason TEXT,
    reason_since REAL,
    ours INTEGER NOT NULL DEFAULT 0,
    quarantined INTEGER NOT NULL DEFAULT 0,
    domain TEXT,
    spare INTEGER NOT NULL DEFAULT 0,
    jobs INTEGER,
    down INTEGER NOT NULL DEFAULT 0,
    taken_for TEXT,          -- a spare taken into service: the node it replaced (take_spare's idempotency)
    first_seen REAL NOT NULL
);
CREATE INDEX nodes_domain ON nodes (domain);
CREATE INDEX nodes_taken_for ON nodes (taken_for);
"""
# Nodes a multi-node sweep holds (agent/fleet/sweep/sweep.py): never taken as a spare until released or expired. Added
# to a database of schema 1 in place (an older file has no such table: nothing is held there).
_SWEEP_HOLDS = ("CREATE TABLE IF NOT EXISTS sweep_holds (node TEXT PRIMARY KEY, sweep TEXT NOT NULL, "
                "until REAL NOT NULL)")
# The actions log's lines not yet written to it (`_logged`): each is added in the transaction of the change it logs
# and forgotten once written, with the id "<instance>:<row id>" that finds it there after a crash. The instance, made
# with the file, tells this database's ids from those of one it replaced.
_OUTBOX = "CREATE TABLE IF NOT EXISTS actions_outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, log TEXT NOT NULL, " \
          "entry TEXT NOT NULL)"
# Jobs the agent acted on (agent/jobs/respond.py): what it did to each, so the demo, the simulator and a retried intent
# see it. A job without a row is one the local scheduler never heard of: taken as running on the node that asks.
_JOBS = ("CREATE TABLE IF NOT EXISTS jobs (scheduler TEXT NOT NULL, id TEXT NOT NULL, run INTEGER, "
         "state TEXT NOT NULL, mark TEXT, requeueable INTEGER, PRIMARY KEY (scheduler, id))")
_COLUMNS = "name, hold, reason, reason_since, ours, quarantined, domain, spare, jobs, down"
# SQLite's primary error names: held by another process (retry), or a file that is not a usable database.
_BUSY = ("SQLITE_BUSY", "SQLITE_LOCKED")
_PASSING = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_PROTOCOL", "SQLITE_INTERRUPT")


class LocalDatabaseError(Refused):
    """The local scheduler's database file cannot be used (corrupt, another program's, unreadable): retrying will
    not help; the message names the file and what to do."""


class LocalDatabase:
    """The database calls (LocalAdapter sets db, timeout_s, _clock and _schema_ok)."""

    db: Path
    timeout_s: float
    _clock: Callable[[], float]
    _schema_ok: bool

    # -- SQLite ------------------------------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        # One connection per call: safe across threads and forked processes, and no handle held between calls.
        try:
            self.db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LocalDatabaseError(f"{self.db}: cannot create its folder: {exc.strerror or exc}") from None
        try:
            db = sqlite3.connect(str(self.db), timeout=self.timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        try:
            if not self._schema_ok:
                self._check_schema(db)
        except BaseException:
            db.close()
            raise
        return db

    def _check_schema(self, db: sqlite3.Connection) -> None:
        # Tables added since schema 1 are made in place (IF NOT EXISTS); the instance id is made once, with them.
        instance = ("INSERT OR IGNORE INTO gpuwarden_local_scheduler VALUES ('instance', ?)", (os.urandom(8).hex(),))
        since = (_SWEEP_HOLDS, _OUTBOX, _JOBS, instance)
        try:
            found = schema_version(db, _SCHEMA, "gpuwarden_local_scheduler", {"nodes"}, str(SCHEMA_VERSION), since)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        if found != str(SCHEMA_VERSION):
            what = "another program's SQLite database" if found is None else f"schema {found!r}, not {SCHEMA_VERSION}"
            raise LocalDatabaseError(f"{self.db}: not a gpuwarden local scheduler database ({what}); point the local "
                                     f"adapter at another file, or move this one aside to start an empty one")
        self._schema_ok = True

    def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return self._call(fn, write=False)

    def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return self._call(fn, write=True)

    def _call(self, fn: Callable[[sqlite3.Connection], Any], write: bool, again: bool = True) -> Any:
        db = self._connect()
        try:
            return write_transaction(db, fn) if write else fn(db)
        except sqlite3.Error as exc:
            if again and "no such table" in str(exc):
                # The file was deleted or emptied since this adapter last looked: start it again, once.
                self._schema_ok = False
                db.close()
                return self._call(fn, write, again=False)
            raise self._error(exc) from None
        finally:
            db.close()

    def _error(self, exc: sqlite3.Error) -> Exception:
        code = getattr(exc, "sqlite_errorname", "") or ""
        if code.startswith(_BUSY) or "locked" in str(exc):
            return Transient(f"{self.db}: held by another process for more than {self.timeout_s:g} s ({exc})")
        if code.startswith(_PASSING):
            return Transient(f"{self.db}: {exc} ({code})")
        self._schema_ok = False  # replaced or damaged since: look again at the next call
        return LocalDatabaseError(f"{self.db}: cannot be used as the local scheduler's database: {exc}"
                                  f"{' (' + code + ')' if code else ''}; check it is a readable file, or move it "
                                  f"aside to start an empty one")

    def _ensure(self, db: sqlite3.Connection, node: str) -> None:
        db.execute("INSERT OR IGNORE INTO nodes (name, first_seen) VALUES (?, ?)", (node, self._clock()))

    def _get(self, db: sqlite3.Connection, node: str) -> NodeView:
        row = db.execute(f"SELECT {_COLUMNS} FROM nodes WHERE name = ?", (node,)).fetchone()
        if row is None:
            raise Refused(f"{node}: not in the local scheduler ({self.db})")
        return _view(row)


def read_views(db: sqlite3.Connection, names: Sequence[str]) -> list[NodeView]:
    """The views of the nodes `names` that a local scheduler database (`db`, a connection open on it) holds: a
    reader that keeps its own connection (the fleet simulator reads after each call)."""
    marks = ",".join("?" * len(names))
    return [_view(r) for r in db.execute(f"SELECT {_COLUMNS} FROM nodes WHERE name IN ({marks})", list(names))]


def _view(row: tuple) -> NodeView:
    name, hold, reason, since, ours, quarantined, domain, spare, jobs, down = row
    if down:
        service = Service.DOWN
    elif hold == "none":
        service = Service.IN_SERVICE
    elif hold == "cordon" or jobs:
        service = Service.CORDONED  # a drain with work left: no new work, the running work goes on
    else:
        service = Service.DRAINED
    return NodeView(name, service, reason, since, bool(ours), bool(quarantined), domain, bool(spare), jobs)
