"""What the agent's own small SQLite files (the local scheduler, the sweep history) share: a write is one
`BEGIN IMMEDIATE` transaction (the write lock first, so the reads in it see what no other process can change
meanwhile), and a versioned schema that is made in an empty file and checked in any other (a file that is another
program's is never written to).
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
