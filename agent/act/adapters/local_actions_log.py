"""The local adapter's actions log (`<state-dir>/actions.jsonl`): every change written exactly once, its line stored in
the change's transaction and appended after it with its id, so a crash between the two leaves it for the next call;
and the dry-run record (`apply`) the daemon's action worker writes. A mixin of LocalAdapter
(agent/act/adapters/local.py)."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable

from gpuwarden.agent.act.adapters.local_db import LocalDatabase
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import Refused, Transient

log = logs.get_logger("gpuwarden.adapter")

MAX_PENDING = 10_000  # lines kept for a log that cannot be written; past this the oldest are dropped
TAIL_BYTES = 1 << 20  # of the log read to find the last line written


class ActionsLog(LocalDatabase):
    """The log's lines (LocalAdapter sets path, node_name, _log_key and _lock)."""

    path: Path
    node_name: str | None
    _log_key: str
    _lock: threading.Lock

    # -- the dry-run record (the daemon's action worker) ----------------------------------------------------------
    def apply(self, action: str, detail: dict[str, Any]) -> None:
        head: dict[str, Any] = {"action": action, "at": self._clock()}
        if self.node_name is not None:
            head["node"] = self.node_name
        line = json.dumps({**head, **detail}, sort_keys=True)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        log.info("would act", action=action, reason=detail.get("reason", ""))

    def actions(self) -> list[dict[str, Any]]:
        """The actions log, oldest first, with the lines a crash left in the database written first; a line a crash
        left torn is skipped."""
        if self.db.exists():  # never made by reading: a dry run has no database
            self._flush()
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def _logged(self, action: str, node: str, change: Callable[[sqlite3.Connection], Any],
                detail_of: Callable[[Any], dict[str, Any]] | None = None, **detail: Any) -> Any:
        """Runs `change` (it returns whether it changed the scheduler's state, or (its value, whether)) in one
        transaction with the actions log's line for it, then writes the line to the log (`_flush`): a crash between
        the two leaves the line in the database, and the next call writes it. Returns what `change` returned."""

        def step(db: sqlite3.Connection) -> tuple[Any, dict[str, Any]]:
            out = change(db)
            changed = out[1] if isinstance(out, tuple) else out
            entry = {"action": action, "at": self._clock(), "node": node, "changed": bool(changed), **detail,
                     **(detail_of(out) if detail_of is not None else {})}
            db.execute("INSERT INTO actions_outbox (log, entry) VALUES (?, ?)",
                       (self._log_key, json.dumps(entry, sort_keys=True)))
            # Bounded while the log cannot be written: the oldest lines go first (ids are shared by every log).
            db.execute("DELETE FROM actions_outbox WHERE log = ? AND id <= (SELECT max(id) FROM actions_outbox) - ?",
                       (self._log_key, MAX_PENDING))
            return out, entry

        out, entry = self._write(step)
        log.info("local scheduler", **entry)
        self._flush()
        return out

    def _flush(self) -> None:
        """Appends the lines the database holds for this log, in order, each with its id, and forgets them, in one
        transaction: a line written whose row a crash kept is found by its id at the log's end and not written again.
        A log that cannot be written keeps its lines in the database for the next call (MAX_PENDING at most)."""

        def flush(db: sqlite3.Connection) -> None:
            rows = db.execute("SELECT id, entry FROM actions_outbox WHERE log = ? ORDER BY id",
                              (self._log_key,)).fetchall()
            if not rows:
                return
            instance = db.execute("SELECT value FROM gpuwarden_local_scheduler WHERE key = 'instance'").fetchone()[0]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, open(self.path, "a+b") as f:
                written, torn = _last_written(f, instance)
                out = [b""] if not torn else [b"\n"]  # a line a crash cut short stays a line of its own (skipped)
                for row_id, entry in rows:
                    if row_id > written:
                        out.append((json.dumps({**json.loads(entry), "id": f"{instance}:{row_id}"},
                                               sort_keys=True) + "\n").encode())
                f.write(b"".join(out))
                f.flush()
                os.fsync(f.fileno())  # on disk before its rows are forgotten
            db.execute("DELETE FROM actions_outbox WHERE log = ? AND id <= ?", (self._log_key, rows[-1][0]))

        try:
            self._write(flush)
        except (OSError, Transient, Refused) as exc:
            # The scheduler's state is the database, and the change stands; its line waits there for the next call.
            log.error("actions log not written; its lines are kept for the next call", path=str(self.path),
                      error=str(exc))


def _last_written(f: Any, instance: str) -> tuple[int, bool]:
    """The highest row id of `instance` among the complete lines of the log's last TAIL_BYTES (0: none there), and
    whether the log ends in a line a crash cut short. The rows not yet forgotten were written after every other line
    of this database, so the last line with one of its ids is the last written."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        return 0, False
    start = max(0, size - TAIL_BYTES)
    f.seek(start)
    tail = f.read(size - start)
    lines = tail.split(b"\n")
    torn = lines.pop() != b""  # after the last newline: empty, or a line cut short
    mark = f'"id": "{instance}:'.encode()
    for line in reversed(lines[1:] if start > 0 else lines):  # the first may be the end of a longer line
        if mark in line:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            ident = entry.get("id") if isinstance(entry, dict) else None
            if isinstance(ident, str) and ident.startswith(f"{instance}:") and ident[len(instance) + 1:].isdigit():
                return int(ident[len(instance) + 1:]), torn
    return 0, torn
