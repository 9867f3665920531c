"""A node's own past sweep figures (small-message p95 latency, large-message bus bandwidth) per group size, from
the groups that passed, so a sweep can judge a SKU or group size nobody configured against what the same nodes
showed before. SQLite (stdlib), bounded: the last `keep` figures per node and group size.

A file that is not this history (corrupt, another program's, a value that is not what was written) raises
SweepHistoryError naming it; nothing is repaired or deleted behind the operator's back."""
from __future__ import annotations

import math
import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.sqlite_files import schema_version, write_transaction
from gpuwarden.agent.fleet.sweep.model import Outcome

SCHEMA_VERSION = "1"
_META = "gpuwarden_sweep_history"
_SCHEMA = f"""
CREATE TABLE {_META} (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE figures (
    id INTEGER PRIMARY KEY AUTOINCREMENT, node TEXT NOT NULL, group_size INTEGER NOT NULL, sku TEXT NOT NULL,
    at REAL NOT NULL, latency_p95_us REAL, busbw_gbps REAL);
CREATE INDEX figures_by_node ON figures (node, group_size, id)
"""
MAX_ROWS = 1_000_000  # the whole table, past any fleet x group sizes x keep: the oldest rows go first
_MAX_NAME = 255  # a hostname is at most 253 characters
_MAX_VALUE = 1e7  # latency (us) and bandwidth (GB/s) figures above this are not what the sweep writes


class SweepHistoryError(GpuwardenError):
    """The history file cannot be used; the message names it and what to do."""


class Learned(NamedTuple):
    latency_p95_us: float | None  # median of the node's past figures; None below min_samples of them
    busbw_gbps: float | None
    samples: int  # past records at this group size (either figure)
    since: float | None  # time of the oldest of them (epoch seconds)


class SweepHistory:
    def __init__(self, path: Path | str, *, keep: int = 50, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        if not 1 <= int(keep) <= 10_000:
            raise ValueError(f"keep must be 1 .. 10000, got {keep}")
        self.path = Path(path)
        self.keep = int(keep)
        self._timeout_s = timeout_s
        self._clock = clock
        self._checked = False
        self._call(lambda db: None, write=False)  # a file that is not a history is said now, not mid-sweep

    def record(self, node: str, nodes_in_group: int, sku: str, judged: Any) -> bool:
        """Keep a PASS group's figures as `node`'s; any other outcome (or no figure) keeps nothing: False."""
        if judged.outcome is not Outcome.PASS:
            return False
        latency, busbw = _value(judged.latency_p95_us), _value(judged.busbw_gbps)
        if latency is None and busbw is None:
            return False
        _name(node, "node")
        _name(sku, "sku")
        group = _group(nodes_in_group)
        now = float(self._clock())

        def write(db: sqlite3.Connection) -> bool:
            db.execute("INSERT INTO figures (node, group_size, sku, at, latency_p95_us, busbw_gbps) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (node, group, sku, now, latency, busbw))
            db.execute("DELETE FROM figures WHERE node = ? AND group_size = ? AND id NOT IN (SELECT id FROM figures "
                       "WHERE node = ? AND group_size = ? ORDER BY id DESC LIMIT ?)",
                       (node, group, node, group, self.keep))
            (rows,) = db.execute("SELECT COUNT(*) FROM figures").fetchone()
            if rows > MAX_ROWS:
                db.execute("DELETE FROM figures WHERE id IN (SELECT id FROM figures ORDER BY id LIMIT ?)",
                           (rows - MAX_ROWS,))
            return True
        return self._call(write, write=True)

    def learned(self, node: str, nodes_in_group: int, min_samples: int = 1) -> Learned:
        """The medians of `node`'s kept figures at this group size; a figure with fewer than `min_samples` values
        is None (too little history to stand for the node)."""
        _name(node, "node")
        group = _group(nodes_in_group)

        def read(db: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return db.execute("SELECT at, latency_p95_us, busbw_gbps FROM figures WHERE node = ? AND group_size = ? "
                              "ORDER BY id DESC LIMIT ?", (node, group, self.keep)).fetchall()
        rows = self._call(read, write=False)
        for row in rows:  # the file is input like any other: a value the sweep never writes means it is not ours
            if not isinstance(row[0], float) or not math.isfinite(row[0]) \
                    or any(v is not None and _value(v) is None for v in row[1:]):
                raise SweepHistoryError(f"{self.path}: a stored figure of {node} is not what the sweep writes "
                                        f"({row!r:.120}); move the file aside to start an empty history")
        lat = [r[1] for r in rows if r[1] is not None]
        bw = [r[2] for r in rows if r[2] is not None]
        need = max(1, int(min_samples))
        return Learned(statistics.median(lat) if len(lat) >= need else None,
                       statistics.median(bw) if len(bw) >= need else None,
                       len(rows), min((r[0] for r in rows), default=None))

    # -- SQLite ------------------------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[sqlite3.Connection], Any], write: bool) -> Any:
        # One connection per call: no handle held between calls, safe if the sweep forks.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SweepHistoryError(f"{self.path}: cannot create its folder: {exc.strerror or exc}") from None
        try:
            db = sqlite3.connect(str(self.path), timeout=self._timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        try:
            if not self._checked:
                self._check_schema(db)
            return write_transaction(db, fn) if write else fn(db)
        except sqlite3.Error as exc:
            self._checked = False
            raise self._error(exc) from None
        finally:
            db.close()

    def _check_schema(self, db: sqlite3.Connection) -> None:
        found = schema_version(db, _SCHEMA, _META, {"figures"}, SCHEMA_VERSION)
        if found != SCHEMA_VERSION:
            what = ("another program's SQLite database" if found is None
                    else f"schema {found!r:.40}, not {SCHEMA_VERSION}")
            raise SweepHistoryError(f"{self.path}: not a gpuwarden sweep history ({what}); point [sweep] at another "
                                    f"file, or move this one aside to start an empty history")
        self._checked = True

    def _error(self, exc: sqlite3.Error) -> SweepHistoryError:
        code = getattr(exc, "sqlite_errorname", "") or ""
        if code.startswith("SQLITE_BUSY") or "locked" in str(exc):
            return SweepHistoryError(f"{self.path}: held by another process for more than {self._timeout_s:g} s "
                                     f"({exc})")
        return SweepHistoryError(f"{self.path}: cannot be used as the sweep history: {exc}"
                                 f"{' (' + code + ')' if code else ''}; check it is a readable file, or move it aside "
                                 f"to start an empty history")


def _value(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= _MAX_VALUE:
        return None
    return float(v)


def _name(value: Any, what: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME or not value.isprintable():
        raise ValueError(f"{what} must be a printable name of 1 .. {_MAX_NAME} characters, got {value!r:.80}")


def _group(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 100_000:
        raise ValueError(f"nodes_in_group must be a whole number from 2 to 100000, got {n!r:.40}")
    return n
