"""The kernel log: /dev/kmsg live (records since boot, non-blocking), a plain file on a recorded node.

The cursor (last sequence number + boot_id) is what the daemon persists so a restart neither misses
nor repeats a record; `KmsgFollower` honours it.
"""
from __future__ import annotations

import copy
import errno
import os
import select
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import logs
from ..errors import ParseError, SourceError
from ..kernel_log import LogRecord, parse_kmsg_filtered, parse_kmsg_text
from . import confine
from .inotify import FolderWaiter

DEV_KMSG = "/dev/kmsg"
_MAX_LOGGED_PARSE_ERRORS = 10  # a corrupt log must not flood the agent's own log
log = logs.get_logger("gpuwarden.kmsg")


@dataclass(frozen=True)
class Cursor:
    boot_id: str | None
    seq: int


class KernelLog:
    def __init__(self, path: Path | str, live: bool, boot_id: str | None = None, name: str | None = None):
        self.path = Path(path)
        # How records name their source in findings: stable across machines ("kmsg" in a scenario), so
        # golden outputs and evidence do not depend on where a scenario was unpacked.
        self.name = name or str(self.path)
        self.live = live
        self.boot_id = boot_id
        self.parse_errors: list[ParseError] = []
        # A recorded log is a scenario's file: it must resolve inside its folder (a bundle from another machine).
        self.inside = None if live else confine.scenario_prefix(self.path.parent)
        self.after_seq: int | None = None  # records() keeps only records after this one (see after())

    def after(self, cursor: "Cursor | None") -> "KernelLog":
        """The same log seen from `cursor` on: what a retest judges, the records since a recovery. A cursor of
        another boot means the whole log (that boot, and the fault with it, is gone)."""
        view = copy.copy(self)
        view.parse_errors = []
        view.after_seq = cursor.seq if cursor is not None and cursor.boot_id == self.boot_id else None
        return view

    def raw_text(self) -> str:
        """The log as /dev/kmsg records, one a line (what `record` saves and `records` parses)."""
        if not self.live:
            try:
                return confine.read_text(self.path, self.inside)
            except FileNotFoundError:
                raise SourceError(f"{self.path}: kernel log missing") from None
            except OSError as exc:
                raise SourceError(f"{self.path}: cannot read kernel log: {exc.strerror or exc}") from None
        fd = _open_kmsg(self.path)
        try:
            return _read_available(fd, self.path)[0]
        finally:
            os.close(fd)

    def records(self) -> list[LogRecord]:
        """Every record since boot. Malformed records are logged and kept in `parse_errors`, not raised; a log
        with no record at all is a SourceError (a booted kernel always has something to say)."""
        records, errors = parse_kmsg_text(self.raw_text(), self.name)
        self.parse_errors = errors
        if self.after_seq is not None:
            # Records keep their sequence numbers; a record without one (not from /dev/kmsg) cannot be placed and
            # is kept: a retest then judges more, never less.
            since = self.after_seq
            records = [r for r in records if r.seq is None or r.seq > since]
            return records
        for err in errors[:_MAX_LOGGED_PARSE_ERRORS]:
            log.warning("malformed kernel log record", error=str(err))
        if not records:
            raise SourceError(f"{self.path}: kernel log holds no record"
                              + (f" ({len(errors)} malformed line(s))" if errors else ""))
        return records


class KmsgFollower:
    """New kernel-log records since the last poll, resuming after a saved cursor.

    Live it keeps /dev/kmsg open non-blocking (one record per read, EAGAIN when caught up, EPIPE when the
    ring buffer overwrote records we had not read yet: counted in `lost`). On a recorded node it follows the
    scenario's kmsg file as it grows, taking only complete lines, and starts over if the file shrinks. Either
    way records at or below the cursor's sequence number of the same boot are skipped, so a restart with the
    persisted cursor neither repeats nor misses a record.
    """

    def __init__(self, log: KernelLog, cursor: Cursor | None = None, keep: Callable[[str], object] | None = None):
        self.log = log
        self.cursor = cursor if cursor is not None and cursor.boot_id == log.boot_id else Cursor(log.boot_id, -1)
        self.keep = keep  # build records only for messages a consumer reads (None: all)
        self.lost = 0
        self.advanced = 0  # records the cursor moved past (kept or not): the daemon's throughput counter
        self.malformed = 0
        self.parse_errors: list[ParseError] = []  # the latest few, for the log; `malformed` counts them all
        self._fd: int | None = None
        self._waiter = FolderWaiter(self.log.path.parent)  # a recorded log: wake when its file is written
        self._offset = 0
        self._pending = b""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._waiter.close()

    def wait(self, timeout_s: float, poll_tick_s: float, wake_fd: int | None = None) -> None:
        """Sleep until the log may hold new records, at most `timeout_s`, or until `wake_fd` is readable. Live
        /dev/kmsg is select()ed; a recorded file is watched through inotify; only where neither works is it
        polled every `poll_tick_s`."""
        if not self.log.live:
            self._waiter.wait(timeout_s, poll_tick_s, wake_fd)
            return
        fds = [fd for fd in (self._fd, wake_fd) if fd is not None]
        try:
            select.select(fds, [], [], timeout_s if self._fd is not None else min(timeout_s, poll_tick_s))
        except (OSError, ValueError):  # a closed or broken descriptor: poll rather than spin
            time.sleep(min(timeout_s, poll_tick_s))

    def poll(self) -> list[LogRecord]:
        text = self._read_live() if self.log.live else self._read_file()
        if not text:
            return []
        if self.keep is None:
            records, errors = parse_kmsg_text(text, self.log.name)
            last = records[-1].seq if records else None
        else:
            records, errors, last = parse_kmsg_filtered(text, self.log.name, self.keep)
        if errors:
            self.malformed += len(errors)
            # Bounded: a daemon runs for months, and a corrupt log must not grow its memory.
            self.parse_errors = (self.parse_errors + errors)[-_MAX_LOGGED_PARSE_ERRORS:]
        fresh = [r for r in records if r.seq is not None and r.seq > self.cursor.seq]
        if last is not None and last > self.cursor.seq:
            # kmsg numbers records consecutively within a boot, so the seq step counts what was read, kept or not.
            self.advanced += last - (self.cursor.seq if self.cursor.seq >= 0 else _first_seq(text, last) - 1)
            self.cursor = Cursor(self.log.boot_id, last)
        return fresh

    def _read_live(self) -> str:
        if self._fd is None:
            self._fd = _open_kmsg(self.log.path)
        text, lost = _read_available(self._fd, self.log.path)
        self.lost += lost
        return text

    def _read_file(self) -> str:
        try:
            size = os.stat(self.log.path).st_size
            if size == self._offset:
                return ""  # nothing new: the common case of an idle poll costs one stat
            if size < self._offset:  # truncated or replaced: read it again from the start
                self._offset, self._pending = 0, b""
            with os.fdopen(confine.open_file(self.log.path, self.log.inside), "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError as exc:
            raise SourceError(f"{self.log.path}: cannot read kernel log: {exc.strerror or exc}") from None
        self._offset += len(data)
        data = self._pending + data
        complete, _, self._pending = data.rpartition(b"\n")  # a line still being written waits for its newline
        return (complete + b"\n").decode(errors="replace") if complete else ""


def _first_seq(text: str, default: int) -> int:
    try:
        return int(text.split(",", 2)[1])
    except (IndexError, ValueError):
        return default


def _open_kmsg(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SourceError(f"{path}: cannot open kernel log: {exc.strerror or exc}") from None


def _read_available(fd: int, path: Path) -> tuple[str, int]:
    """Every record /dev/kmsg has for this descriptor now, and how many overwrites (EPIPE) were met.

    /dev/kmsg returns one record per read() and EAGAIN when caught up (non-blocking); a regular file
    (tests, a scenario) returns data until EOF."""
    chunks: list[bytes] = []
    lost = 0
    while True:
        try:
            data = os.read(fd, 8192)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                break
            if exc.errno == errno.EPIPE:
                lost += 1  # overwritten before we read it; the next read resumes at the oldest record
                continue
            raise SourceError(f"{path}: read failed: {exc.strerror}") from None
        if not data:
            break
        chunks.append(data if data.endswith(b"\n") else data + b"\n")
    return b"".join(chunks).decode(errors="replace"), lost
