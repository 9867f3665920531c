"""What the agent's own SQLite files (the daemon's state store, the local scheduler, the sweep history) share: a
write is one `BEGIN IMMEDIATE` transaction (the write lock first, so the reads in it see what no other process can
change meanwhile), and a versioned schema that is made in an empty file and checked in any other (a file that is
another program's, or one whose tables were edited, is never written to as if it were ours).
"""
from __future__ import annotations

import sqlite3
from typing import Any, Callable, Collection, Sequence


def write_transaction(db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], Any]) -> Any:
    """`fn(db)` in one BEGIN IMMEDIATE transaction, committed if it returns and rolled back if it raises.
    `db` is in autocommit mode (isolation_level=None)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        result = fn(db)
        db.execute("COMMIT")
        return result
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def schema_version(db: sqlite3.Connection, schema: str, meta: str, tables: Collection[str], version: str,
                   since: Sequence[str | tuple[str, tuple[Any, ...]]] = ()) -> str | None:
    """The schema version the file holds, in one write transaction: in an empty file `schema` (statements split at
    ";", not executescript, which would commit the open transaction) is made first, with `version` in the `meta`
    table's "schema" row. None: not a file of ours (other tables, or no version). `since`: statements run where the
    version is `version` (tables added since, IF NOT EXISTS), each a statement or (statement, parameters)."""

    def look(db: sqlite3.Connection) -> str | None:
        existing = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not existing:
            for statement in schema.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"INSERT INTO {meta} VALUES ('schema', ?)", (version,))
            found: str | None = version
        elif {meta, *tables} <= existing:
            row = db.execute(f"SELECT value FROM {meta} WHERE key = 'schema'").fetchone()
            found = row[0] if row else None
        else:
            found = None
        if found == version:
            for statement in since:
                db.execute(*((statement,) if isinstance(statement, str) else statement))
        return found

    return write_transaction(db, look)


def schema_objects(db: sqlite3.Connection) -> tuple[dict[str, set[str]], set[str]]:
    """What the file holds: each table with its columns, and the names of its other objects (index, view, trigger;
    "type name"). SQLite's own (sqlite_*: the AUTOINCREMENT counters, the indexes of PRIMARY KEY / UNIQUE) are left
    out: they come with the tables."""
    tables: dict[str, set[str]] = {}
    others: set[str] = set()
    for kind, name in db.execute("SELECT type, name FROM sqlite_master").fetchall():
        if name.startswith("sqlite_"):
            continue
        if kind == "table":
            tables[name] = {row[1] for row in db.execute(f'PRAGMA table_info("{name}")').fetchall()}
        else:
            others.add(f"{kind} {name}")
    return tables, others


def schema_problems(found: tuple[dict[str, set[str]], set[str]], required: dict[str, set[str]],
                    known: dict[str, set[str]]) -> list[str]:
    """What is missing from or foreign to a file's objects (`schema_objects`): every table and column of `required`
    (what the file's version wrote) must be there; nothing outside `known` (every version's tables and columns) may
    be. Empty: the file is one of ours."""
    tables, others = found
    problems = [f"table {t} missing" for t in sorted(required.keys() - tables.keys())]
    problems += [f"column {t}.{c} missing" for t in sorted(required.keys() & tables.keys())
                 for c in sorted(required[t] - tables[t])]
    problems += [f"foreign table {t}" for t in sorted(tables.keys() - known.keys())]
    problems += [f"foreign column {t}.{c}" for t in sorted(tables.keys() & known.keys())
                 for c in sorted(tables[t] - known[t])]
    problems += [f"foreign {o}" for o in sorted(others)]
    return problems
