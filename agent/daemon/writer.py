"""The daemon's writer (a mixin of agent.daemon.loop.Daemon): memory to SQLite, outside the lock. Each consistent
cut of what memory holds and the store does not is written in one transaction (agent/state/store.py); a write that
failed (disk full, database locked) is retried after a backoff while detection goes on in memory; a state folder
deleted under it, or a database file truncated or overwritten under it, is recreated from memory (the damaged
file set aside). The store's health, as /metrics and `gpuwarden status` read it, is told here.
"""
from __future__ import annotations

import os
from typing import Any

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.backoff import Backoff

log = logs.get_logger("gpuwarden.daemon")
_BUSY_S = 5.0  # a write may wait this long on a database another process has locked (store.BUSY_TIMEOUT_S)


class StoreWriter:
    """Needs from the daemon: opt, store, engine, stop_event, _lock, _records, _meta, _dirty, _meta_dirty,
    _node_dirty, _new_intents, _done, _write_wanted, _write_mutex, _store_error, _store_error_since,
    _store_failures, _status_socket, _set_meta(), _publish(), _sleep(), _beat(), _beat_off() and _fail_loop()."""

    def _store_health(self) -> tuple[str | None, float | None]:
        """Why the store is failing now and since when, or (None, None): the last write's error, else what is wrong
        with the file (it can be truncated under a daemon whose writes, into SQLite's WAL, still succeed). Read at
        each scrape and by `status` (the socket), so both say what the file is now; lock-free: a stat and a 16-byte
        read of a local file, never the daemon's lock. A fault found here wakes the writer, which sets it aside."""
        error, since = self._store_error, self._store_error_since
        if error is not None:
            return error, since
        fault = self.store.file_fault()
        if fault is None:
            return None, None
        self._write_wanted.set()
        return f"{self.store.path} {fault}", self.opt.clock()

    def _status_answer(self) -> dict[str, Any]:
        error, since = self._store_health()
        return {"pid": os.getpid(), "store": {"ok": error is None, "error": error, "since": since,
                                              "failed_writes": self._store_failures}}

    def _writer_loop(self) -> None:
        backoff = Backoff(self.opt.error_backoff_s, self.opt.retry_max_s)  # the retries of a failed write
        while not self.stop_event.is_set():
            failing = self._store_error is not None
            wait = backoff.next_wait if failing else self.opt.store_check_s
            self._beat("writer", wait + 2 * _BUSY_S)
            if failing:
                # The retry waits out its backoff however many observations come meanwhile: each is kept in memory
                # and goes in the next cut, and a full disk is not asked again at every XID.
                self._sleep(wait)
            else:
                self._write_wanted.wait(wait)
            if self.stop_event.is_set():
                break  # stop() writes the last cut itself
            self._write_wanted.clear()
            try:
                ok = self._write_once()
            except Exception as exc:  # noqa: BLE001 - a bug in the writer must not end it
                self._fail_loop("writer", None, exc)
                ok = False
            if ok:
                backoff.succeeded()
            elif failing:  # the first failure is retried after `first`: it was not waited for
                backoff.failed()
        self._beat_off("writer")

    def _write_once(self) -> bool:
        """Writes one cut of what memory holds and the store does not; False (kept pending) when it failed."""
        with self._write_mutex:
            cut = None
            try:
                if self.store.moved():
                    self._recreate_store()
                elif (fault := self.store.file_fault()) is not None:
                    self._recreate_store(fault)
                with self._lock:
                    cut = self._take_cut()
                if cut is not None:
                    self.store.commit(*cut)
            except Exception as exc:  # noqa: BLE001 - StoreError, or an OSError from a vanished folder
                with self._lock:
                    if cut is not None:
                        self._put_back(cut)
                    self._store_failed(exc)
                return False
            with self._lock:
                if self._store_error is not None:
                    self._store_recovered()
            return True

    def _take_cut(self) -> tuple | None:
        if not (self._dirty or self._meta_dirty or self._node_dirty or self._new_transitions or self._new_intents
                or self._done):
            return None
        checks = [self._records[n] for n in sorted(self._dirty) if n in self._records]
        meta = {k: self._meta[k] for k in sorted(self._meta_dirty)}
        node = self._record if self._node_dirty else None
        cut = (checks, meta, node, list(self._new_transitions), list(self._new_intents), list(self._done))
        self._dirty, self._meta_dirty, self._node_dirty = set(), set(), False
        self._new_transitions, self._new_intents, self._done = [], [], []
        return cut

    def _put_back(self, cut: tuple) -> None:
        """A cut that could not be written goes back before what came since (the next cut takes both)."""
        checks, meta, node, transitions, intents, done = cut
        self._dirty |= {c.name for c in checks}
        self._meta_dirty |= set(meta)
        self._node_dirty = self._node_dirty or node is not None
        self._new_transitions[:0] = transitions
        self._new_intents[:0] = intents
        self._done[:0] = done

    def _recreate_store(self, damaged: str | None = None) -> None:
        """A fresh database from what memory holds: the state folder was deleted or replaced (`damaged` None), or the
        file was damaged under the daemon (`damaged` says how; the file is set aside and named)."""
        if damaged is None:
            log.error("state folder deleted or replaced while running; recreating it", path=str(self.store.path))
        else:
            log.error("state store damaged while running; setting it aside, writing a fresh one from memory",
                      path=str(self.store.path), damage=damaged)
        try:
            self.store.reopen(damaged)
        finally:
            if damaged is None and self._status_socket is not None:
                try:
                    self._status_socket.rebind()  # it went with the folder
                except OSError as exc:
                    log.warning("cannot make the status socket again", error=str(exc))
        if self.store.set_aside:
            log.error("state store set aside", detail=self.store.set_aside)
        with self._lock:
            # The new database starts empty: everything memory holds is written again, the intents not yet done
            # included (a restart must still find them).
            self._dirty |= set(self._records)
            self._meta_dirty |= set(self._meta)
            self._node_dirty = True
            done = {k for k, *_ in self._done}
            journalled = {k for k, _, _ in self._new_intents}
            self._new_intents.extend(i for i in self.engine.pending() if i[0] not in done and i[0] not in journalled)
            if self.store.set_aside:
                self._set_meta("store_set_aside", {"at": self.opt.clock(), "detail": self.store.set_aside})
            self._store_failed(RuntimeError(f"state store {damaged}; set aside and recreated" if damaged
                                            else "state folder was deleted or replaced; recreated"))

    def _store_failed(self, exc: BaseException) -> None:
        reason = str(exc) if str(exc) else type(exc).__name__
        self._store_failures += 1
        if self._store_error != reason:
            log.error("state store write failed; detection goes on in memory, retrying", error=reason)
        if self._store_error is None:
            self._store_error_since = self.opt.clock()
        self._store_error = reason
        self._publish()

    def _store_recovered(self) -> None:
        log.warning("state store writable again; pending state written", error_was=self._store_error)
        self._set_meta("store_fault", {"error": self._store_error, "since": self._store_error_since,
                                       "until": self.opt.clock()})
        self._store_error = self._store_error_since = None
        self._publish()
