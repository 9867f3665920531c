"""The local adapter: gpuwarden's embedded scheduler, for one node with no scheduler, the demo, and a simulated
fleet. The scheduler's state is one SQLite file (`db`) that every node of a simulated fleet shares; it holds each
node's service (in service, cordoned, drained), the drain reason and who set it, the node's NVLink domain and
the spare pools. A node is added the first time a call names it: one node, no scheduler, it just works.

It keeps the adapter contract (agent/core/scheduler.py): every call is idempotent; every call is one SQLite
transaction (`BEGIN IMMEDIATE`, so two processes racing for a spare are serialised by SQLite, and exactly one of
them gets it) bounded by SQLite's busy timeout (`timeout_s`; a database held longer by another process raises
`Transient`); what is not ours (an administrator's drain, see `admin_drain`) is never resumed (`Refused`); a
database that is not one (corrupt, another program's, unreadable) raises `LocalDatabaseError` naming the file.

Every call that changes (or would have changed) the scheduler's state is also written as one JSON line to the
actions log (`path`, `<state-dir>/actions.jsonl`), with `changed` false for a repeat that found nothing to do, and
exactly once: the line is stored in the call's transaction and appended after it with its id (`_logged`), so a crash
between the two leaves it for the next call to append, and one already appended is not appended again.
`apply(action, detail)` writes only that line and acts on nothing: it records what the agent *would* do in
dry-run mode (`actions()` reads the log back). It is called from the daemon's action worker (never under the
lock detection holds), one intent at a time, and is idempotent by construction (a replay writes the line again,
detail "replayed": true).

The calls `admin_drain`, `admin_resume`, `set_down` and `set_jobs` are the world outside the agent (an
administrator, a node that stops answering, work starting and ending), for the demo and the fleet simulator.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gpuwarden.agent.act.spares import healthy_spares
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import (
    JOB_STATES,
    REASON_PREFIX,
    SPARE_REASON,
    JobView,
    NodeView,
    Refused,
    Service,
    Transient,
)
from gpuwarden.agent.core.sqlite_files import schema_version, write_transaction

log = logs.get_logger("gpuwarden.adapter")

SCHEMA_VERSION = 1
MAX_NAME = 255  # a node or domain name (DNS names are at most 253)
MAX_REASON = 1024  # a reason longer than this is cut: it is a log line, not a document
MAX_JOBS = 1 << 20

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
MAX_PENDING = 10_000  # lines kept for a log that cannot be written; past this the oldest are dropped
TAIL_BYTES = 1 << 20  # of the log read to find the last line written
_COLUMNS = "name, hold, reason, reason_since, ours, quarantined, domain, spare, jobs, down"
# SQLite's primary error names: held by another process (retry), or a file that is not a usable database.
_BUSY = ("SQLITE_BUSY", "SQLITE_LOCKED")
_PASSING = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_PROTOCOL", "SQLITE_INTERRUPT")


class LocalDatabaseError(Refused):
    """The local scheduler's database file cannot be used (corrupt, another program's, unreadable): retrying will
    not help; the message names the file and what to do."""


class LocalAdapter:
    name = "local"

    def __init__(self, path: Path, *, db: Path | None = None, timeout_s: float = 5.0, node_name: str | None = None,
                 clock: Callable[[], float] = time.time):
        """`path`: the actions log (JSON lines). `db`: the scheduler's SQLite file, shared by the nodes of a
        simulated fleet (default: `local-scheduler.db` beside the log). `node_name`: the node `apply` speaks for
        (named in its lines). Nothing is opened here: the database is opened (and created) by the first call that
        needs it."""
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and 0 < timeout_s <= 600):
            raise ValueError(f"local adapter timeout_s must be from 0 to 600 seconds, not {timeout_s!r}")
        self.path = Path(path)
        self._log_key = str(self.path.absolute())  # the log's lines in the database (a fleet's logs share it)
        self.db = Path(db) if db is not None else self.path.parent / "local-scheduler.db"
        self.timeout_s = float(timeout_s)
        self.node_name = node_name
        self._clock = clock
        self._lock = threading.Lock()  # one writer of the actions log at a time within this process
        self._schema_ok = False

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

    # -- the scheduler's view ---------------------------------------------------------------------------------------
    def nodes(self) -> Sequence[NodeView]:
        return self._read(lambda db: [_view(r) for r in db.execute(f"SELECT {_COLUMNS} FROM nodes ORDER BY name")])

    def node(self, node: str) -> NodeView:
        node = _name(node, "node")

        def look(db: sqlite3.Connection) -> NodeView:
            self._ensure(db, node)
            return self._get(db, node)
        return self._write(look)

    def spares(self, domain: str) -> list[str]:
        domain = _name(domain, "domain")
        rows = self._read(lambda db: [_view(r) for r in db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE domain = ? AND spare = 1", (domain,))])
        return list(healthy_spares(rows, domain))

    # -- the agent's calls --------------------------------------------------------------------------------------------
    def cordon(self, node: str, reason: str) -> None:
        self._hold("cordon", node, reason)

    def drain(self, node: str, reason: str) -> None:
        self._hold("drain", node, reason)

    def quarantine(self, node: str, reason: str) -> None:
        self._hold("quarantine", node, reason)

    def _hold(self, action: str, node: str, reason: str) -> None:
        node, reason = _name(node, "node"), _reason(reason)
        hold = "cordon" if action == "cordon" else "drain"

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            v = self._get(db, node)
            if v.reason is not None and not v.ours:
                if action == "quarantine":
                    raise Refused(f"{node} is held by someone else ({v.reason!r}): gpuwarden does not take over "
                                  f"another's drain to quarantine it")
                return False  # already out of service by another's hand: left as it is, never taken over
            was = db.execute("SELECT hold, reason, quarantined, spare FROM nodes WHERE name = ?", (node,)).fetchone()
            new_hold = "drain" if was[0] == "drain" else hold  # never loosened: a drained node stays drained
            quarantined = 1 if action == "quarantine" else was[2]
            if (was[0], was[1], was[2], was[3]) == (new_hold, reason, quarantined, 0):
                return False
            # A drain of ours keeps the time it began (the breaker's window); a spare held out of service that
            # now has a fault of its own leaves the pool, and its drain begins now.
            since = v.reason_since if v.ours and not v.spare and v.reason_since is not None else self._clock()
            # A taken spare that is held again is no longer the answer to a retried take_spare.
            db.execute("UPDATE nodes SET hold = ?, reason = ?, reason_since = ?, ours = 1, quarantined = ?, "
                       "spare = 0, taken_for = NULL WHERE name = ?", (new_hold, reason, since, quarantined, node))
            return True
        self._logged(action, node, change, reason=reason)

    def resume(self, node: str) -> None:
        node = _name(node, "node")

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            v = self._get(db, node)
            if v.reason is None:
                return False
            if not v.ours:
                raise Refused(f"{node} is held by someone else ({v.reason!r}): gpuwarden resumes only its own drains")
            db.execute("UPDATE nodes SET hold = 'none', reason = NULL, reason_since = NULL, ours = 0, "
                       "quarantined = 0, spare = 0, taken_for = NULL WHERE name = ?", (node,))
            db.execute("UPDATE nodes SET taken_for = NULL WHERE taken_for = ?", (node,))
            return True
        self._logged("resume", node, change)

    def publish_domain(self, node: str, domain: str) -> None:
        node, domain = _name(node, "node"), _name(domain, "domain")

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            return db.execute("UPDATE nodes SET domain = ? WHERE name = ? AND domain IS NOT ?",
                              (domain, node, domain)).rowcount > 0
        self._logged("publish_domain", node, change, domain=domain)

    def take_spare(self, domain: str, for_node: str) -> str | None:
        domain, for_node = _name(domain, "domain"), _name(for_node, "node")

        def take(db: sqlite3.Connection) -> tuple[str | None, bool]:
            # One BEGIN IMMEDIATE transaction: the read of the pool and the take are one step for every process
            # sharing the file; a second agent waits for the first to commit, then reads the pool without it.
            self._ensure(db, for_node)
            row = db.execute("SELECT name FROM nodes WHERE taken_for = ? ORDER BY name LIMIT 1", (for_node,)).fetchone()
            if row is not None:
                return row[0], False  # a retried intent: the spare already taken for this node
            held = {r[0] for r in db.execute("SELECT node FROM sweep_holds WHERE until > ?", (self._clock(),))}
            pool = [_view(r) for r in db.execute(f"SELECT {_COLUMNS} FROM nodes WHERE domain = ? AND spare = 1",
                                                 (domain,)) if r[0] not in held]
            candidates = healthy_spares(pool, domain, exclude=for_node)
            if not candidates:
                return None, False
            db.execute("UPDATE nodes SET hold = 'none', reason = NULL, reason_since = NULL, ours = 0, quarantined = 0,"
                       " spare = 0, taken_for = ? WHERE name = ?", (for_node, candidates[0]))
            return candidates[0], True
        spare, _ = self._logged("take_spare", for_node, take, lambda taken: {"spare": taken[0]}, domain=domain)
        return spare

    def return_to_pool(self, node: str, domain: str) -> None:
        node, domain = _name(node, "node"), _name(domain, "domain")

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            v = self._get(db, node)
            if v.reason is not None and not v.ours:
                raise Refused(f"{node} is held by someone else ({v.reason!r}): gpuwarden does not take it into "
                              f"a spare pool")
            hold = db.execute("SELECT hold FROM nodes WHERE name = ?", (node,)).fetchone()[0]
            if v.spare and v.domain == domain and hold == "drain" and v.reason == SPARE_REASON:
                return False
            db.execute("UPDATE nodes SET hold = 'drain', reason = ?, reason_since = ?, ours = 1, quarantined = 0, "
                       "spare = 1, domain = ?, taken_for = NULL WHERE name = ?", (SPARE_REASON, self._clock(), domain,
                                                                                   node))
            db.execute("UPDATE nodes SET taken_for = NULL WHERE taken_for = ?", (node,))
            return True
        self._logged("return_to_pool", node, change, domain=domain)

    def hold_for_sweep(self, sweep: str, nodes: Sequence[str], for_s: float) -> None:
        """Holds `nodes` for a sweep for at most `for_s` seconds: take_spare passes them over until then (a spare in
        a sweep is busy, and its verdict is not known yet)."""
        names = [_name(n, "node") for n in nodes]
        until = self._clock() + max(0.0, min(float(for_s), 7 * 86400.0))

        def change(db: sqlite3.Connection) -> bool:
            db.executemany("INSERT OR REPLACE INTO sweep_holds VALUES (?, ?, ?)", [(n, sweep, until) for n in names])
            return bool(names)
        self._logged("hold_for_sweep", ",".join(names)[:MAX_REASON], change, sweep=sweep, until=until)

    def release_sweep(self, sweep: str) -> None:
        def change(db: sqlite3.Connection) -> bool:
            return db.execute("DELETE FROM sweep_holds WHERE sweep = ? OR until <= ?",
                              (sweep, self._clock())).rowcount > 0
        self._logged("release_sweep", sweep, change)

    # -- jobs (agent/jobs/respond.py) --------------------------------------------------------------------------------
    def job(self, job: Any) -> JobView | None:
        scheduler, ident = _name(job.scheduler, "scheduler"), _name(job.id, "job")
        row = self._read(lambda db: db.execute("SELECT run, state, mark, requeueable FROM jobs WHERE scheduler = ? "
                                               "AND id = ?", (scheduler, ident)).fetchone())
        if row is None:
            return JobView(ident, "running", (), job.run, None, None)
        run, state, mark, requeueable = row
        return JobView(ident, state if state in JOB_STATES else "unknown", (), run, None if requeueable is None
                       else bool(requeueable), mark)

    def mark_job(self, job: Any, reason: str) -> None:
        self._job_change("mark_job", job, lambda state, run: (state, run), mark=_reason(reason))

    def signal_job(self, job: Any, signal: str) -> None:
        self._job_change("signal_job", job, lambda state, run: (state, run), signal=_text(signal, "signal", 16))

    def requeue_job(self, job: Any) -> bool:
        was: list[str] = []

        def requeue(state: str, run: int | None) -> tuple[str, int | None]:
            was.append(state)
            if state == "pending":
                return state, run  # requeued already: a repeat is a no-op
            return "pending", (run or 0) + 1
        self._job_change("requeue_job", job, requeue)
        return was[-1:] != ["pending"]

    def cancel_job(self, job: Any) -> None:
        self._job_change("cancel_job", job, lambda state, run: ("ended", run))

    def set_job(self, job: Any, state: str, requeueable: bool | None = None) -> None:
        """The world outside the agent: a job starts (again), ends, is (not) requeueable."""
        if state not in JOB_STATES:
            raise Refused(f"job state must be one of {', '.join(JOB_STATES)}, not {state!r}")

        def change(db: sqlite3.Connection) -> bool:
            db.execute("INSERT INTO jobs (scheduler, id, run, state, requeueable) VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT (scheduler, id) DO UPDATE SET state = excluded.state, "
                       "requeueable = excluded.requeueable", (job.scheduler, job.id, job.run, state,
                                                             None if requeueable is None else int(requeueable)))
            return True
        self._write(change)

    def _job_change(self, action: str, job: Any, then: Callable[[str, int | None], tuple[str, int | None]],
                    mark: str | None = None, **detail: Any) -> None:
        scheduler, ident = _name(job.scheduler, "scheduler"), _name(job.id, "job")

        def change(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT run, state, mark FROM jobs WHERE scheduler = ? AND id = ?",
                             (scheduler, ident)).fetchone()
            run, state, old_mark = row if row is not None else (job.run, "running", None)
            new_state, new_run = then(state, run)
            new_mark = mark if mark is not None else old_mark
            db.execute("INSERT OR REPLACE INTO jobs (scheduler, id, run, state, mark, requeueable) VALUES "
                       "(?, ?, ?, ?, ?, (SELECT requeueable FROM jobs WHERE scheduler = ? AND id = ?))",
                       (scheduler, ident, new_run, new_state, new_mark, scheduler, ident))
            return (new_state, new_run, new_mark) != (state, run, old_mark) or action == "signal_job"
        self._logged(action, self.node_name or "", change, job=f"{scheduler}:{ident}",
                     **({"mark": mark} if mark is not None else {}), **detail)

    # -- the world outside the agent (demo, fleet simulator) ----------------------------------------------------------
    def admin_drain(self, node: str, reason: str) -> None:
        """An administrator drains `node` (never ours: gpuwarden will not resume it)."""
        node = _name(node, "node")
        reason = _text(reason, "reason", MAX_REASON) or "admin"

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            db.execute("UPDATE nodes SET hold = 'drain', reason = ?, reason_since = ?, ours = 0, quarantined = 0, "
                       "spare = 0 WHERE name = ?", (reason, self._clock(), node))
            return True
        self._logged("admin_drain", node, change, reason=reason)

    def admin_resume(self, node: str) -> None:
        """An administrator puts `node` back in service, whoever held it."""
        node = _name(node, "node")

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            return db.execute("UPDATE nodes SET hold = 'none', reason = NULL, reason_since = NULL, ours = 0, "
                              "quarantined = 0, spare = 0 WHERE name = ? AND hold != 'none'", (node,)).rowcount > 0
        self._logged("admin_resume", node, change)

    def set_down(self, node: str, down: bool = True) -> None:
        """The scheduler loses (or finds again) `node`'s daemon."""
        node = _name(node, "node")

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            return db.execute("UPDATE nodes SET down = ? WHERE name = ? AND down != ?",
                              (int(bool(down)), node, int(bool(down)))).rowcount > 0
        self._logged("set_down", node, change, down=bool(down))

    def set_jobs(self, node: str, jobs: int | None) -> None:
        """Work running on `node` (None: not known). A drain with work left shows as cordoned until it ends."""
        node = _name(node, "node")
        if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or not 0 <= jobs <= MAX_JOBS):
            raise Refused(f"jobs must be a whole number from 0 to {MAX_JOBS} or None, not {jobs!r}")

        def change(db: sqlite3.Connection) -> bool:
            self._ensure(db, node)
            return db.execute("UPDATE nodes SET jobs = ? WHERE name = ? AND jobs IS NOT ?",
                              (jobs, node, jobs)).rowcount > 0
        self._write(change)

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


def _text(value: Any, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise Refused(f"{what} must be text, not {type(value).__name__}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        value = "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in value)
    return value.strip()[:limit]


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME or value != value.strip() \
            or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise Refused(f"{what} name must be 1 to {MAX_NAME} printable characters, not {str(value)[:80]!r}")
    return value


def _reason(value: Any) -> str:
    reason = _text(value, "reason", MAX_REASON)
    if not reason.startswith(REASON_PREFIX):
        reason = f"{REASON_PREFIX} {reason}".strip()[:MAX_REASON]  # the mark that makes it ours
    return reason
