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
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
import threading
import time
from dataclasses import field
from itertools import compress
from operator import is_not
from pathlib import Path
from typing import Any, Iterable

from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.model import Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.sqlite_files import write_transaction
from gpuwarden.agent.state.store_schema import KMSG_CURSOR, SchemaError, boot_id_of, cursor_row, make_or_migrate, seq_of
from gpuwarden.agent.state.transitions import NodeRecord, NodeState, Transition

# A check's state and findings are written in parts (table check_parts, agent/state/store_schema.py), each part only
# when it changed, so a commit costs what changed, not what the check holds (the xid check's incidents, one per GPU and
# XID, each written when it moved): "state:<key>" / <entry> is one entry of a top-level state value that maps names to
# objects; "finding" / <index> is one finding. The checks row keeps the rest of the state and the status. Rows an
# older version wrote (the whole state and findings in the checks row, no parts) read the same.
_SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
_FINDING = "finding"
_STATE = "state:"
# The WAL is checkpointed into the database every this many pages (PASSIVE, by the committing thread) and cut back
# to JOURNAL_LIMIT after a checkpoint: it stays about a MiB whatever the daemon's uptime (SQLite's defaults, 1000
# pages and no limit, leave a file of 4 MB and more that a checkpoint never shrinks).
WAL_AUTOCHECKPOINT_PAGES = 256
JOURNAL_LIMIT_BYTES = 1 << 20
LOCK_NAME = "gpuwarden.lock"
BUSY_TIMEOUT_S = 5.0  # a database locked by another process fails a write after this (the writer retries)
# SQLite result codes that mean the file's content cannot be trusted (sqlite3.h), as opposed to a write that
# failed for now (SQLITE_FULL, SQLITE_BUSY, SQLITE_IOERR, SQLITE_READONLY, SQLITE_CANTOPEN).
_UNREADABLE = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}


@dataclass
class _Group:
    """What the database holds of one split state value: each entry (the object last written or read) and its
    place (ord), and the place a new entry takes."""

    values: dict[str, Any]
    ords: dict[str, int]
    next: int


@dataclass
class _Held:
    """What the database holds of one check's parts: its split state values by part, and its findings."""

    groups: dict[str, _Group]
    findings: tuple[Finding, ...]


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


class StoreUnreadable(StoreError):
    """The database or a value in it is not what the daemon writes: set aside, never half-trusted."""


class StateInUse(StoreError):
    """Another daemon holds the state folder."""


class Store:
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
        self._parts: dict[str, _Held] = {}
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
        if self._want_lock and not self._holds_lock():
            self._take_lock()
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
            if _unreadable(exc):
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
            if _unreadable(exc):
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

    def _take_lock(self) -> None:
        """flock on the state folder's lock file, the holder's PID written in it. Raises StateInUse naming it."""
        path = self.path.parent / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(f"{path}: cannot open the lock file: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateInUse(f"{self.path.parent} is in use by another gpuwarden daemon "
                                 f"({'pid ' + holder if holder else 'pid unknown'}, lock {path})") from None
            raise StoreError(f"{path}: cannot lock: {exc.strerror or exc}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd

    def _holds_lock(self) -> bool:
        """Whether the lock file we hold is still the one in the folder (it goes with a deleted folder)."""
        if self._lock_fd is None:
            return False
        try:
            held, there = os.fstat(self._lock_fd), (self.path.parent / LOCK_NAME).stat()
        except OSError:
            return False
        return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)

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

    # -- reads (raise StoreUnreadable naming the row that is not what the daemon writes) -------------------------
    def node(self) -> NodeRecord | None:
        row = self._one("SELECT record FROM node WHERE id = 1")
        return _decode("node record", lambda: NodeRecord.from_dict(json.loads(row[0]))) if row else None

    def counted(self) -> tuple[str | None, int] | None:
        """The kernel-log records counted: every record of this boot id up to this seq (None: none yet)."""
        row = self._one("SELECT boot_id, seq FROM kmsg_counted WHERE id = 1")
        if not row:
            return None
        return _decode("kmsg_counted", lambda: (boot_id_of(row[0]), seq_of(row[1])))

    def meta(self, key: str) -> Any:
        row = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        if not row:
            return None
        return row[0] if key == "schema" else _decode(f"meta {key!r}", lambda: json.loads(row[0]))

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
        record, known = _check_record(row, parts)
        if not self.readonly:
            self._parts[record.name] = known
        return record

    def transitions(self, limit: int = 20) -> list[Transition]:
        rows = self._all("SELECT at, frm, too, reason, actions FROM transitions ORDER BY id DESC LIMIT ?", (limit,))
        return [_decode(f"transition at {r[0]!r}", lambda r=r: Transition(
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
                 "detail": _decode(f"intent {k!r}", lambda x=x: _object(json.loads(x))), "outcome": o}
                for k, a, c, d, x, o in rows]

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        rows = self._all(sql, args)
        return rows[0] if rows else None

    def _all(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                if _unreadable(exc):
                    raise StoreUnreadable(f"{self.path}: {exc}") from None
                raise StoreError(f"{self.path}: read failed: {exc}") from None

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
                written = {c.name: self._write_check(c) for c in checks}
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

    def _write_check(self, c: CheckRecord) -> _Held:
        """Writes one check's row and those of its parts that differ from what the database holds (inside the
        caller's transaction); returns what the database then holds of its parts. The work is what changed: the
        entries and findings that are the objects last written are passed over at C speed, never visited one by one
        in Python (a node holding many incidents writes only the one an XID moved)."""
        name = c.name
        old = self._parts.get(name)
        if old is None:
            if not self._parts_complete:  # not known: every part written, whatever an earlier run left removed
                self._db.execute("DELETE FROM check_parts WHERE name = ?", (name,))
            old = _Held({}, ())
        # Changed in place: a commit that fails drops the whole of it (commit), so nothing half-updated is kept.
        held = old
        rest: dict[str, Any] = {}
        rows: list[tuple] = []
        gone: list[tuple] = []
        groups: dict[str, _Group] = {}
        for key, value in c.state.items():
            part = _STATE + key
            group = held.groups.get(part)
            if not (isinstance(value, dict) and value):
                rest[key] = value
                continue
            before = group.values if group is not None else {}
            changed = list(compress(value.keys(), map(is_not, value.values(), map(before.get, value.keys()))))
            # A value that maps names to objects is split into entries; the entries last written are objects still.
            if not all(isinstance(value[sub], dict) for sub in (changed if group is not None else value)):
                rest[key] = value
                continue
            if group is None:
                group = _Group({}, {}, 0)
            values, ords = group.values, group.ords
            for sub in changed:
                entry = value[sub]
                was = values.get(sub)
                values[sub] = entry  # the object now held: the next commit's identity test
                if was is not None and was == entry:
                    continue
                order = ords.get(sub)
                if order is None:  # a new entry goes last; an entry keeps its place (read back in the order they came)
                    order = ords[sub] = group.next
                    group.next += 1
                rows.append((name, part, str(sub), order, json.dumps(entry)))
            if len(values) > len(value):
                live = {str(sub) for sub in value}  # a key read back as text may be given as a number
                for sub in values.keys() - value.keys():
                    del values[sub], ords[sub]
                    if str(sub) not in live:
                        gone.append((name, part, str(sub)))
            groups[part] = group
        for part, group in held.groups.items():
            if part not in groups:
                gone.extend((name, part, str(sub)) for sub in group.values)
        findings, before_f = c.findings, held.findings
        common = min(len(findings), len(before_f))
        for i in compress(range(common), map(is_not, findings, before_f)):
            if findings[i] != before_f[i]:
                rows.append((name, _FINDING, str(i), i, json.dumps(findings[i].to_dict())))
        rows.extend((name, _FINDING, str(i), i, json.dumps(findings[i].to_dict()))
                    for i in range(common, len(findings)))
        gone.extend((name, _FINDING, str(i)) for i in range(common, len(before_f)))
        if rows:
            self._db.executemany("INSERT OR REPLACE INTO check_parts VALUES (?, ?, ?, ?, ?)", rows)
        if gone:
            self._db.executemany("DELETE FROM check_parts WHERE name = ? AND part = ? AND sub = ?", gone)
        self._db.execute("INSERT OR REPLACE INTO checks VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (name, json.dumps(rest), c.status.value, c.error, "[]", c.updated, c.duration_s))
        held.groups, held.findings = groups, tuple(findings)
        return held

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


def _unreadable(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", None)
    if name:
        return name.startswith(tuple(_UNREADABLE))
    text = str(exc)
    return "not a database" in text or "malformed" in text


def _decode(where: str, build: Any) -> Any:
    try:
        return build()
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise StoreUnreadable(f"{where}: {type(exc).__name__}: {exc}") from None


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"want an object, got {type(value).__name__}")
    return value


def _check_record(row: tuple, parts: list[tuple] = ()) -> tuple[CheckRecord, _Held]:
    """A check's record from its row and its parts (ordered by part, then ord), and what the parts hold."""
    name, state, status, error, findings, updated, duration = row

    def build() -> tuple[CheckRecord, _Held]:
        whole = _object(json.loads(state))
        listed = [Finding.from_dict(f) for f in json.loads(findings)]
        # Findings an older version kept in the row are not parts: the first write puts each in a part of its own.
        from_row = len(listed)
        groups: dict[str, _Group] = {}
        for _name, part, sub, order, value in parts:
            if part == _FINDING:
                listed.append(Finding.from_dict(json.loads(value)))
            elif part.startswith(_STATE):
                item = _object(json.loads(value))
                entries = whole.setdefault(part[len(_STATE):], {})
                _object(entries)[sub] = item
                group = groups.get(part)
                if group is None:
                    group = groups[part] = _Group({}, {}, 0)
                group.values[sub] = item
                group.ords[sub] = int(order)
                group.next = max(group.next, int(order) + 1)
            else:
                raise ValueError(f"unknown part {part!r}")
        record = CheckRecord(str(name), whole, Status(status), error, tuple(listed), float(updated), float(duration))
        return record, _Held(groups, (None,) * from_row + tuple(listed[from_row:]))

    return _decode(f"check {name!r}", build)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isascii() and text.isdigit() else ""
