"""The daemon's state store as a file (agent/state/store.py): the tables and columns each version of the agent wrote,
the check at open that a file is one of them (every table and column of the version it names, nothing foreign), and what
opening a file of an earlier version adds. A file that fails the check is set aside by the store, never written to.
"""
from __future__ import annotations

import json
import sqlite3
from typing import Any

from gpuwarden.agent.core.sqlite_files import schema_objects, schema_problems

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
    key TEXT PRIMARY KEY, action TEXT NOT NULL, created REAL NOT NULL, done REAL, detail TEXT NOT NULL,
    outcome TEXT);
CREATE TABLE IF NOT EXISTS check_parts (
    name TEXT NOT NULL, part TEXT NOT NULL, sub TEXT NOT NULL, ord INTEGER NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (name, part, sub)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kmsg_counted (id INTEGER PRIMARY KEY CHECK (id = 1), boot_id TEXT, seq INTEGER NOT NULL);
"""
SCHEMA_VERSION = "4"
# What each version added to the file (a table: all its columns): a file names the version that last opened it, and
# must hold every table and column of that version; what later versions add is made at open (a file a newer daemon
# opened, then an older one, holds both). Anything else in the file is foreign: set aside, never written to.
_ADDED_IN: dict[str, dict[str, set[str] | None]] = {
    "1": {"meta": None, "node": None, "checks": None, "transitions": None, "intents": {"key", "action", "created",
                                                                                       "done", "detail"}},
    "2": {"intents": {"outcome"}},
    "3": {"check_parts": None},
    "4": {"kmsg_counted": None},
}
KMSG_CURSOR = "kmsg_cursor"  # meta: where the kernel-log follower stands; written with the row of kmsg_counted
# Columns added after a table's first release, added to an existing database at open (ALTER TABLE ... ADD COLUMN:
# the rows already there read NULL, what an older daemon would have meant).
_ADDED_COLUMNS = (("intents", "outcome", "TEXT"),)


class SchemaError(ValueError):
    """The file is not a store of a version this agent knows, or its tables were edited: what is wrong."""


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})").fetchall()}


def make_or_migrate(db: sqlite3.Connection) -> None:
    """In one transaction: an empty file gets the schema; any other must be a store of a version this agent knows,
    holding every table and column of that version and nothing foreign (else SchemaError, naming what), and gets
    what later versions added."""
    found = schema_objects(db)
    version = None
    if found != ({}, set()):
        version = _version_of(db, found)
        problems = schema_problems(found, _required(version), _required(SCHEMA_VERSION))
        if problems:
            raise SchemaError(f"schema version {version}: {'; '.join(problems)}")
    for statement in SCHEMA.split(";"):  # not executescript, which would commit the open transaction
        if statement.strip():
            db.execute(statement)
    for table, column, kind in _ADDED_COLUMNS:
        if column not in _columns(db, table):
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    if version is not None and int(version) < 4:
        # Before version 4 the cursor alone said what was counted; a row an earlier version-4 run left is stale (an
        # older daemon since moved the cursor without it).
        db.execute("DELETE FROM kmsg_counted")
        row = db.execute("SELECT value FROM meta WHERE key = ?", (KMSG_CURSOR,)).fetchone()
        try:
            cursor = cursor_row(json.loads(row[0])) if row else None
        except ValueError:
            cursor = None  # not JSON: the store's whole-file read that follows sets the file aside
        if cursor is not None:
            db.execute("INSERT INTO kmsg_counted VALUES (1, ?, ?)", cursor)
    db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))


def _version_of(db: sqlite3.Connection, found: tuple[dict[str, set[str]], set[str]]) -> str:
    if not {"key", "value"} <= found[0].get("meta", set()):
        raise SchemaError("schema: no meta table (not a gpuwarden state store)")
    row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    version = row[0] if row else None
    if version not in _ADDED_IN:
        raise SchemaError(f"schema version {version!r} is not one this agent knows ({', '.join(_ADDED_IN)})")
    return version


def _required(version: str) -> dict[str, set[str]]:
    """The tables and columns a file of `version` holds."""
    tables = _schema_tables()
    out: dict[str, set[str]] = {}
    for v, added in _ADDED_IN.items():
        if int(v) > int(version):
            break
        for table, columns in added.items():
            out.setdefault(table, set()).update(tables[table] if columns is None else columns)
    return out


_TABLES: dict[str, set[str]] = {}


def _schema_tables() -> dict[str, set[str]]:
    """The current schema's tables and columns, read from SCHEMA itself (made once in memory)."""
    if not _TABLES:
        db = sqlite3.connect(":memory:")
        try:
            db.executescript(SCHEMA)
            for table, column, kind in _ADDED_COLUMNS:
                if column not in _columns(db, table):
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            _TABLES.update(schema_objects(db)[0])
        finally:
            db.close()
    return _TABLES


def cursor_row(value: Any) -> tuple[str | None, int] | None:
    """(boot_id, seq) of a kernel-log cursor as the daemon writes it, or None when it is not one."""
    if not isinstance(value, dict):
        return None
    try:
        return boot_id_of(value.get("boot_id")), seq_of(value.get("seq"))
    except (TypeError, ValueError):
        return None


def boot_id_of(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"boot id {value!r} is not text")
    return value


def seq_of(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"seq {value!r} is not a whole number")
    return value
