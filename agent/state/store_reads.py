"""The state store's reads (a mixin of agent/state/store.py Store): each raises StoreUnreadable naming the row that
is not what the daemon writes, and StoreError when the database cannot be read now. A read of the checks also
tells the store what the database holds of their parts (agent/state/check_record.py), so that the next write of
each writes only what changed.
"""
from __future__ import annotations

import json
import sqlite3
from typing import Any

from gpuwarden.agent.state.check_record import CheckRecord, read_check
from gpuwarden.agent.state.store_errors import StoreError, StoreUnreadable, as_object, decode, unreadable
from gpuwarden.agent.state.store_schema import boot_id_of, seq_of
from gpuwarden.agent.state.transitions import NodeRecord, NodeState, Transition


class StoreReads:
    """Needs from the store: path, readonly, _db, _lock, _parts and _parts_complete."""

    # -- reads (raise StoreUnreadable naming the row that is not what the daemon writes) -------------------------
    def node(self) -> NodeRecord | None:
        row = self._one("SELECT record FROM node WHERE id = 1")
        return decode("node record", lambda: NodeRecord.from_dict(json.loads(row[0]))) if row else None

    def counted(self) -> tuple[str | None, int] | None:
        """The kernel-log records counted: every record of this boot id up to this seq (None: none yet)."""
        row = self._one("SELECT boot_id, seq FROM kmsg_counted WHERE id = 1")
        if not row:
            return None
        return decode("kmsg_counted", lambda: (boot_id_of(row[0]), seq_of(row[1])))

    def meta(self, key: str) -> Any:
        row = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        if not row:
            return None
        return row[0] if key == "schema" else decode(f"meta {key!r}", lambda: json.loads(row[0]))

    def check(self, name: str) -> CheckRecord | None:
        with self._lock:  # the row and its parts from one snapshot (no write of this store between them)
            row = self._one("SELECT name, state, status, error, findings, updated, duration_s FROM checks "
                            "WHERE name = ?", (name,))
            parts = self._all("SELECT name, part, sub, ord, value FROM check_parts WHERE name = ? "
                              "ORDER BY name, part, ord", (name,)) if row and self._has_parts() else []
        return self._assemble(row, parts) if row else None

    def checks(self) -> list[CheckRecord]:
        with self._lock:
            rows = self._all("SELECT name, state, status, error, findings, updated, duration_s FROM checks "
                             "ORDER BY name")
            parts = self._all("SELECT name, part, sub, ord, value FROM check_parts ORDER BY name, part, ord") \
                if self._has_parts() else []
            by_name: dict[str, list[tuple]] = {}
            for p in parts:
                by_name.setdefault(p[0], []).append(p)
            records = [self._assemble(r, by_name.get(r[0], [])) for r in rows]
            if not self.readonly and not (set(by_name) - {r[0] for r in rows}):
                self._parts = {r.name: self._parts[r.name] for r in records}
                self._parts_complete = True
        return records

    def _has_parts(self) -> bool:
        """Whether the parts table is there: a database an older version wrote, read by `status` (read-only) before a
        newer daemon opened it, has none."""
        if not self.readonly:
            return True
        return bool(self._all("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'check_parts'"))

    def _assemble(self, row: tuple, parts: list[tuple]) -> CheckRecord:
        record, known = read_check(row, parts)
        if not self.readonly:
            self._parts[record.name] = known
        return record

    def transitions(self, limit: int = 20) -> list[Transition]:
        rows = self._all("SELECT at, frm, too, reason, actions FROM transitions ORDER BY id DESC LIMIT ?", (limit,))
        return [decode(f"transition at {r[0]!r}", lambda r=r: Transition(
            NodeState(r[1]), NodeState(r[2]), str(r[3]), tuple(json.loads(r[4])), float(r[0]))) for r in rows]

    def intents(self, pending_only: bool = False, limit: int = -1) -> list[dict[str, Any]]:
        """The journal in the order the intents were made (`limit`: the newest that many, still oldest first).
        `outcome` is what carrying the intent out gave ("done", "refused: ...", "already so at the scheduler",
        "dry-run", ...); None while pending, and for intents an older version marked done."""
        # A database an older version wrote, read by `status` before a newer daemon opened it, has no outcome column.
        columns = {row[1] for row in self._all("PRAGMA table_info(intents)")}
        outcome = "outcome" if "outcome" in columns else "NULL"
        sql = f"SELECT key, action, created, done, detail, {outcome} FROM intents"
        sql += " WHERE done IS NULL" if pending_only else ""
        sql += " ORDER BY created DESC, rowid DESC LIMIT ?"
        rows = list(reversed(self._all(sql, (limit,))))
        return [{"key": k, "action": a, "created": c, "done": d,
                 "detail": decode(f"intent {k!r}", lambda x=x: as_object(json.loads(x))), "outcome": o}
                for k, a, c, d, x, o in rows]

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        rows = self._all(sql, args)
        return rows[0] if rows else None

    def _all(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                if unreadable(exc):
                    raise StoreUnreadable(f"{self.path}: {exc}") from None
                raise StoreError(f"{self.path}: read failed: {exc}") from None

