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

The SQLite plumbing is in local_db.py, the actions log in local_actions_log.py.
"""
from __future__ import annotations

import math
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gpuwarden.agent.act.adapters.local_actions_log import ActionsLog
from gpuwarden.agent.act.adapters.local_db import _COLUMNS, LocalDatabase, _view
from gpuwarden.agent.act.spares import healthy_spares
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import JOB_STATES, REASON_PREFIX, SPARE_REASON, JobView, NodeView, Refused

log = logs.get_logger("gpuwarden.adapter")

MAX_NAME = 255  # a node or domain name (DNS names are at most 253)
MAX_REASON = 1024  # a reason longer than this is cut: it is a log line, not a document
MAX_JOBS = 1 << 20


class LocalAdapter(ActionsLog, LocalDatabase):
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
