"""The daemon's durable state in SQLite (stdlib): node record and transition history, each passive check's
state and latest findings, the kernel-log cursor, and the journal of remediation intents.

Every write is one transaction (check states + findings + cursors + node record + transitions + intents), taken
from one consistent cut of the daemon's memory, so a crash or kill -9 at any point leaves either the state before
or the state after it: never an XID counted twice or lost, never a downtime accumulator behind its cursor. WAL
mode: readers (`gpuwarden status`) do not block the daemon; the WAL is checkpointed and cut back, so it stays about a
MiB. A check's state entries (an incident, a port) and findings are rows of their own, each written only when it
changed: a commit costs what moved, however many incidents the node holds.

What can go wrong with the file is told apart: a write that fails (disk full, database locked) is a StoreError
the caller retries; a database that cannot be read (not a database, malformed, a value that is not what was
written, tables or columns missing or foreign to the version it names) is set aside as state.db.corrupt-<time> and
a fresh one started; a state folder deleted or replaced under a running daemon is noticed (`moved()`) and recreated
(`reopen()`), and so is a file truncated or overwritten under it (`file_fault()`), the damaged one set aside. One
daemon per state folder: a lock on `gpuwarden.lock` (flock, released by the kernel when its holder dies) names the
PID that holds it.

The kernel-log records the consumers have counted are kept by their identity, (boot id, seq): kmsg numbers a boot's
records one after the other and the follower reads them in order, so the set is every record of the boot up to a
seq, one row (table kmsg_counted), written with the counts it stands for. The cursor in meta (`kmsg_cursor`, what
a retest and older readers use) is the same value; where the two differ, the row says what was counted.

Here: opening, the folder under a running daemon, the one write. Elsewhere: the reads (agent/state/store_reads.py),
a check's record and its parts (agent/state/check_record.py), the folder's lock (agent/state/folder_lock.py), the
errors (agent/state/store_errors.py), the schema (agent/state/store_schema.py).
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from gpuwarden.agent.core.sqlite_files import write_transaction
from gpuwarden.agent.state.check_record import CheckRecord, Held, write_check
from gpuwarden.agent.state.folder_lock import holds_lock, take_lock
from gpuwarden.agent.state.store_errors import StoreError, StoreUnreadable, unreadable
from gpuwarden.agent.state.store_reads import StoreReads
from gpuwarden.agent.state.store_schema import KMSG_CURSOR, SchemaError, cursor_row, make_or_migrate
from gpuwarden.agent.state.transitions import NodeRecord, Transition

_SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
# The WAL is checkpointed into the database every this many pages (PASSIVE, by the committing thread) and cut back
# to JOURNAL_LIMIT after a checkpoint: it stays about a MiB whatever the daemon's uptime (SQLite's defaults, 1000
# pages and no limit, leave a file of 4 MB and more that a checkpoint never shrinks).
WAL_AUTOCHECKPOINT_PAGES = 256
JOURNAL_LIMIT_BYTES = 1 << 20
BUSY_TIMEOUT_S = 5.0  # a database locked by another process fails a write after this (the writer retries)


class Store(StoreReads):
    """`readonly`: for `gpuwarden status`, which must never create, lock, repair or wait on anything.
    `lock`: take the state folder's lock first (the daemon), so two daemons never share one folder."""

    def __init__(self, path: Path, readonly: bool = False, lock: bool = False,
                 busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self._busy_timeout_s = busy_timeout_s
        self.readonly = readonly
        self.set_aside: str | None = None  # what a start found unreadable and moved away, said once by the daemon
        self._lock = threading.RLock()  # one user at a time (sqlite3 connections are not thread-safe); reopen() reads
        self._lock_fd: int | None = None
        self._want_lock = lock and not readonly
        self._identity: tuple | None = None
        self._size_seen = 0  # the database file's size after the last write: it never shrinks (no VACUUM)
        # What the database holds of each check's parts, as last written or read. A commit compares against it and
        # writes only what differs; a check not here has all its parts rewritten.
        self._parts: dict[str, Held] = {}
        # Whether `_parts` holds every check the database has parts of (true after a whole read, until a write fails):
        # a check not in it then has none, and its first write needs no clean-up.
        self._parts_complete = False
        if readonly:
            self._db = self._connect(f"{self.path.absolute().as_uri()}?mode=ro", uri=True)
            return
        self._open()

    # -- opening ------------------------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.path.parent}: cannot create the state folder: {exc.strerror or exc}") from None
        if self._want_lock and not holds_lock(self._lock_fd, self.path.parent):
            fd = take_lock(self.path.parent)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            self._lock_fd = fd
        try:
            self._db = self._init_db()
            self._verify()
        except StoreUnreadable as exc:
            self._db.close()
            self.set_aside = self._set_aside(f"could not be read ({exc})")
            self._db = self._init_db()
        self._identity = _identity(self.path)
        self._size_seen = _size(self.path)

    def _connect(self, target: str, uri: bool = False) -> sqlite3.Connection:
        try:
            return sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=self._busy_timeout_s,
                                   uri=uri)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open state database: {exc}") from None

    def _init_db(self) -> sqlite3.Connection:
        db = self._connect(str(self.path))
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed write survives a crash
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
            db.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT_BYTES}")
            write_transaction(db, make_or_migrate)
        except SchemaError as exc:
            self._db = db
            raise StoreUnreadable(str(exc)) from None
        except sqlite3.Error as exc:
            if unreadable(exc):
                self._db = db
                raise StoreUnreadable(f"{exc}") from None
            db.close()
            raise StoreError(f"{self.path}: cannot open state database: {exc}") from None
        return db

    def _verify(self) -> None:
        """Reads everything once: what the daemon cannot read back is found now, not in the middle of a run."""
        try:
            (result,) = self._db.execute("PRAGMA quick_check").fetchone()
        except sqlite3.Error as exc:
            if unreadable(exc):
                raise StoreUnreadable(str(exc)) from None
            raise StoreError(f"{self.path}: cannot read state database: {exc}") from None
        if result != "ok":
            raise StoreUnreadable(f"quick_check: {result}")
        self.node()
        self.checks()
        for (key,) in self._db.execute("SELECT key FROM meta").fetchall():
            self.meta(key)
        self.transitions(limit=-1)
        self.intents()
        self.counted()

    def _set_aside(self, why: str) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():  # a second one within the second keeps the first
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                os.replace(src, Path(f"{target}{suffix}"))
        return f"{self.path} {why}; set aside as {target.name}, started a fresh one"

    # -- the folder under a running daemon --------------------------------------------------------------------
    def moved(self) -> bool:
        """Whether the state folder or the database was deleted or replaced since it was opened (a daemon that
        went on writing would write into deleted files)."""
        return self._identity is not None and _identity(self.path) != self._identity

    def file_fault(self) -> str | None:
        """Why the database file is no longer the one this store wrote (deleted, replaced, truncated, its header
        overwritten), or None. SQLite goes on committing into its WAL over a file truncated under it, so its writes
        alone do not tell. Lock-free and cheap (a stat and a 16-byte read): asked before each write and at each
        scrape of /metrics."""
        try:
            size = os.stat(self.path).st_size
        except OSError as exc:
            return f"is gone ({exc.strerror or exc})"
        if self.moved():
            return "was replaced while in use"
        seen = self._size_seen
        if size < seen:
            return f"was truncated to {size} bytes while in use (it held {seen})"
        if seen:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    head = os.pread(fd, len(_SQLITE_HEADER), 0)
                finally:
                    os.close(fd)
            except OSError as exc:
                return f"cannot be read ({exc.strerror or exc})"
            if head != _SQLITE_HEADER and not head.strip(b"\0"):
                # Cut under the daemon, then written past its start by SQLite's own checkpoint before this look:
                # the file is as long as before, its start a hole of zeros.
                return "was truncated while in use (its first bytes are zeros: it was cut and written past its start)"
            if head != _SQLITE_HEADER:
                return "was overwritten while in use (its first bytes are not SQLite's header)"
        return None

    def reopen(self, damaged: str | None = None) -> None:
        """A fresh database where the old one was (the folder recreated, the lock taken again). `damaged`: why the
        file there is not ours any more (file_fault()); it is set aside first, as at a start."""
        with self._lock:
            self._parts.clear()
            self._parts_complete = False
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self.set_aside = None
            if damaged is not None and self.path.exists():
                try:
                    self.set_aside = self._set_aside(damaged)
                except OSError as exc:
                    raise StoreError(f"{self.path} {damaged}; cannot set it aside: {exc.strerror or exc}") from None
            self._open()
            if damaged is not None and self.set_aside is None:
                self.set_aside = f"{self.path} {damaged}; started a fresh one"

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # the kernel drops the flock with the last descriptor
                self._lock_fd = None
    # -- the one write ------------------------------------------------------------------------------------------
    def commit(self, checks: Iterable[CheckRecord] = (), meta: dict[str, Any] | None = None,
               node: NodeRecord | None = None, transition: Transition | Iterable[Transition] | None = None,
               intents: Iterable[tuple[str, str, dict[str, Any]]] = (),
               done: Iterable[tuple[str, float] | tuple[str, float, str]] = ()) -> list[str]:
        """Write everything one cut of the daemon's memory holds, atomically. Intents are (key, action, detail);
        a key that exists already is not written again (idempotency); `done` marks intents carried out, as
        (key, at) or (key, at, outcome). Returns
        the intent keys newly written. Raises StoreError (nothing written) when the write fails."""
        transitions = [transition] if isinstance(transition, Transition) else list(transition or ())
        checks = list({c.name: c for c in checks}.values())  # one record per check: the last one given
        new_keys: list[str] = []
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                written = {c.name: write_check(self._db, c, self._parts.get(c.name), self._parts_complete)
                           for c in checks}
                for key, value in (meta or {}).items():
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
                if meta and KMSG_CURSOR in meta:
                    # The records counted, by identity, in the transaction of the counts they make.
                    cursor = cursor_row(meta[KMSG_CURSOR])
                    if cursor is not None:
                        self._db.execute("INSERT OR REPLACE INTO kmsg_counted VALUES (1, ?, ?)", cursor)
                if node is not None:
                    self._db.execute("INSERT OR REPLACE INTO node VALUES (1, ?)", (json.dumps(node.to_dict()),))
                for t in transitions:
                    self._db.execute("INSERT INTO transitions (at, frm, too, reason, actions) VALUES (?, ?, ?, ?, ?)",
                                     (t.at, t.frm.value, t.to.value, t.reason, json.dumps(list(t.actions))))
                for key, action, detail in intents:
                    cur = self._db.execute("INSERT OR IGNORE INTO intents (key, action, created, done, detail) "
                                           "VALUES (?, ?, ?, NULL, ?)",
                                           (key, action, detail.get("at", 0.0), json.dumps(detail)))
                    if cur.rowcount:
                        new_keys.append(key)
                for key, at, *outcome in done:
                    self._db.execute("UPDATE intents SET done = ?, outcome = ? WHERE key = ? AND done IS NULL",
                                     (at, outcome[0] if outcome else "done", key))
                self._db.execute("COMMIT")
            except BaseException as exc:
                # A failed COMMIT (SQLITE_FULL) may already have ended the transaction: ROLLBACK then raises "no
                # transaction is active", which must not hide the real error.
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                # What the database holds of these checks is not known for sure now: their next write is whole.
                for c in checks:
                    self._parts.pop(c.name, None)
                self._parts_complete = False
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"{self.path}: write failed: {exc}") from None
                raise
            self._parts.update(written)
            self._size_seen = max(self._size_seen, _size(self.path))
        return new_keys

    def mark_done(self, key: str, at: float, outcome: str = "done") -> None:
        self.commit(done=[(key, at, outcome)])

    def forget(self, names: Iterable[str]) -> None:
        """Drop the records of checks the daemon no longer runs (an older version's names): left in place, their
        last findings would hold the node's state and show in `status` for ever."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                names = [(n,) for n in names]
                self._db.executemany("DELETE FROM checks WHERE name = ?", names)
                self._db.executemany("DELETE FROM check_parts WHERE name = ?", names)
                self._db.execute("COMMIT")
                for (n,) in names:
                    self._parts.pop(n, None)
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise StoreError(f"{self.path}: write failed: {exc}") from None


def record_meta(path: Path, key: str, value: Any, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
    """One meta value written into the database of a daemon that may be running (`gpuwarden breaker reset`): a
    short transaction of its own, which the daemon reads at its next turn. Never creates, locks the folder, repairs
    or sets aside anything; a missing database is an error that says so."""
    if not Path(path).exists():
        raise StoreError(f"{path}: no daemon state here (is `gpuwarden run` using another --state-dir?)")
    try:
        db = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=rw", uri=True, isolation_level=None,
                             timeout=busy_timeout_s)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open state database: {exc}") from None
    try:
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: write failed: {exc}") from None
    finally:
        db.close()


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _identity(path: Path) -> tuple | None:
    try:
        folder, db = path.parent.stat(), path.stat()
    except OSError:
        return None
    return (folder.st_dev, folder.st_ino, db.st_dev, db.st_ino)
