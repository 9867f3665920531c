"""The kernel log: /dev/kmsg live (records since boot, non-blocking), a plain file on a recorded node.

The cursor (last sequence number + boot_id) is what the daemon persists so a restart neither misses
nor repeats a record; `KmsgFollower` honours it. A record's identity is (boot_id, seq): where a saved cursor
disagrees with the records the store says were counted, those win (`resume_cursor`), and a cursor ahead of the
kernel's newest record of its boot is taken back to it once the log has been read (`KmsgFollower.ahead`). The cursor
is kmsg_cursor.py's; the scan of the bytes a follower reads, kmsg_scan.py's.
"""
from __future__ import annotations

import copy
import errno
import os
import select
import time
from pathlib import Path
from typing import Callable

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ParseError, SourceError
from gpuwarden.agent.core.kernel_log import KmsgBatch, LogRecord, parse_kmsg_filtered, parse_kmsg_text
from gpuwarden.agent.core.line_search import ProbeMemory
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.inotify import FolderWaiter
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.sources.kmsg_scan import MAX_LINE, Interest, KmsgScan, first_seq, numbered_from, unnumbered

DEV_KMSG = "/dev/kmsg"
_MAX_LOGGED_PARSE_ERRORS = 10  # a corrupt log must not flood the agent's own log
# A followed file is read in pieces this size, each scanned once per substring a consumer reads and once for malformed
# lines (measured: pieces of 64 KiB to 1 MiB scan alike, ~2.3M lines/s on a 2-core VM against ~0.9M for the
# record-by-record parse; bench/stream.py).
_PIECE = 1 << 16
_POLL_BYTES = 16 << 20  # read per poll at most; the rest is `more` (memory stays flat on a backlog of any size)
# Records the consumers read, per poll at most (then `more`): a flood of lines they all read (every line an XID) is
# judged in batches of about this many, so the daemon's memory stays flat under it (a 16 MiB poll of XID lines would
# be ~200k records, ~100 MB, and the allocator keeps much of that once freed).
_POLL_RECORDS = 1024
log = logs.get_logger("gpuwarden.kmsg")


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
            return _read_available_bytes(fd, self.path)[0].decode(errors="replace")
        finally:
            os.close(fd)

    def records(self) -> list[LogRecord]:
        """Every record since boot. Malformed records are logged and kept in `parse_errors`, not raised; a log
        with no record at all is a SourceError (a booted kernel always has something to say)."""
        records, errors = parse_kmsg_text(self.raw_text(), self.name)
        if self.live:
            records, errors = unnumbered(records, errors)
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
    persisted cursor neither repeats nor misses a record. A cursor past the newest record the log holds once it has
    been read from its start cannot be right (kmsg numbers a boot's records one by one): it is taken back to that
    record, so the records that come next are read (`ahead` says from where to where).
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
        self._skipping = False  # inside an over-long line: dropped up to its newline
        self.more = False  # the last poll stopped at its byte budget: more is there to read now
        self._probe_memory = ProbeMemory()  # what the pieces read so far taught of the interest's probe bytes
        # The recorded file's lines read before this poll's: a record's line is the file's own, whichever poll read
        # it (live /dev/kmsg is no file: its records carry no line, their seq names them).
        self._file_lines = 0
        self._from_start = True  # reading the log from its oldest record (at open, and after a file shrank)
        self._top: int | None = None  # the newest seq read since then
        self.ahead: tuple[int, int] | None = None  # (cursor seq, newest seq) when a cursor ahead was taken back

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
        if isinstance(self.keep, Interest) and self.keep.raw is not None:
            scanned = self._scan_live() if self.log.live else self._scan_file()
            if scanned is None:
                return []
            (records, errors, last), first = scanned
        else:
            text = self._read_live() if self.log.live else self._read_file()
            if not text:
                return []
            if self.keep is None:
                records, errors = parse_kmsg_text(text, self.log.name)
                last = records[-1].seq if records else None
            else:
                records, errors, last = parse_kmsg_filtered(text, self.log.name, self.keep)
            first = first_seq(text, last) if last is not None else None
            if self.log.live:
                records, errors = unnumbered(records, errors)
            else:
                records, errors = numbered_from(self._file_lines, records, errors)
                self._file_lines += text.count("\n")
        if errors:
            self.malformed += len(errors)
            # Bounded: a daemon runs for months, and a corrupt log must not grow its memory.
            self.parse_errors = (self.parse_errors + errors)[-_MAX_LOGGED_PARSE_ERRORS:]
        fresh = [r for r in records if r.seq is not None and r.seq > self.cursor.seq]
        if last is not None and last > self.cursor.seq:
            # kmsg numbers records consecutively within a boot, so the seq step counts what was read, kept or not.
            before = self.cursor.seq if self.cursor.seq >= 0 else (first if first is not None else last) - 1
            self.advanced += last - before
            self.cursor = Cursor(self.log.boot_id, last)
        if last is not None and (self._top is None or last > self._top):
            self._top = last
        if self._from_start and not self.more:
            self._caught_up()
        return fresh

    def _caught_up(self) -> None:
        """The log has been read from its start to its end: a cursor past its newest record is taken back to it."""
        self._from_start = False
        top = self._top
        if top is not None and self.cursor.seq > top:
            log.warning("kernel-log cursor is ahead of the kernel's newest record of this boot; reading on from that "
                        "record", boot_id=self.log.boot_id, cursor_seq=self.cursor.seq, newest_seq=top)
            self.ahead = (self.cursor.seq, top)
            self.cursor = Cursor(self.log.boot_id, top)

    def _read_live(self) -> str:
        return self._read_live_bytes().decode(errors="replace")

    def _read_live_bytes(self) -> bytes:
        if self._fd is None:
            self._fd = _open_kmsg(self.log.path)
        data, lost = _read_available_bytes(self._fd, self.log.path, _PIECE)
        self.lost += lost
        # A piece a poll: a kernel that logs as fast as it is read must not grow one poll's records without end.
        self.more = len(data) >= _PIECE
        return data

    def _scan_live(self) -> "tuple[KmsgBatch, int | None] | None":
        """The records /dev/kmsg has now, scanned as a recorded file's pieces are (each record ends with a newline)."""
        data = self._read_live_bytes()
        if not data:
            return None
        scan = KmsgScan(self.log.name, self.keep, self._probe_memory, numbered=False)
        scan.feed(data, len(data))
        return KmsgBatch(scan.records, scan.errors, scan.last), scan.first

    def _read_file(self) -> str:
        try:
            size = os.stat(self.log.path).st_size
            if size == self._offset:
                return ""  # nothing new: the common case of an idle poll costs one stat
            if size < self._offset:  # truncated or replaced: read it again from the start
                self._offset, self._pending, self._file_lines = 0, b"", 0
                self._from_start, self._top = True, None
            with os.fdopen(confine.open_file(self.log.path, self.log.inside), "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError as exc:
            raise SourceError(f"{self.log.path}: cannot read kernel log: {exc.strerror or exc}") from None
        self._offset += len(data)
        data = self._pending + data
        complete, _, self._pending = data.rpartition(b"\n")  # a line still being written waits for its newline
        return (complete + b"\n").decode(errors="replace") if complete else ""

    def _scan_file(self) -> "tuple[KmsgBatch, int | None] | None":
        """What was appended to the recorded file since the last poll, as parse_kmsg_filtered would give it for the
        complete lines, and the seq of the first of them; None when nothing new. Read in cache-sized pieces, at most
        _POLL_BYTES per poll (`more` says when the budget stopped it)."""
        self.more = False
        try:
            size = os.stat(self.log.path).st_size
            if size == self._offset:
                return None  # nothing new: the common case of an idle poll costs one stat
            if size < self._offset:  # truncated or replaced: read it again from the start
                self._offset, self._pending, self._skipping, self._file_lines = 0, b"", False, 0
                self._from_start, self._top = True, None
            fd = confine.open_file(self.log.path, self.log.inside)
        except OSError as exc:
            raise SourceError(f"{self.log.path}: cannot read kernel log: {exc.strerror or exc}") from None
        scan = KmsgScan(self.log.name, self.keep, self._probe_memory, lines=self._file_lines)
        try:
            budget = _POLL_BYTES
            while budget > 0 and len(scan.records) < _POLL_RECORDS:
                try:
                    data = os.pread(fd, min(_PIECE, budget), self._offset)
                except OSError as exc:
                    raise SourceError(f"{self.log.path}: cannot read kernel log: {exc.strerror or exc}") from None
                if not data:
                    break
                self._offset += len(data)
                budget -= len(data)
                self._piece(scan, data)
            self.more = budget <= 0 or len(scan.records) >= _POLL_RECORDS
        finally:
            os.close(fd)
        read, self._file_lines = scan.lines - self._file_lines, scan.lines
        if not read and not scan.errors:
            return None
        return KmsgBatch(scan.records, scan.errors, scan.last), scan.first

    def _piece(self, scan: "KmsgScan", data: bytes) -> None:
        if self._skipping:  # the rest of an over-long line
            nl = data.find(b"\n")
            if nl < 0:
                return
            self._skipping, data = False, data[nl + 1:]
        data = self._pending + data if self._pending else data
        cut = data.rfind(b"\n") + 1  # a line still being written waits for its newline
        if cut:
            scan.feed(data, cut)
        self._pending = data[cut:]
        if len(self._pending) > MAX_LINE:
            scan.too_long(self._pending)
            self._pending, self._skipping = b"", True


def _open_kmsg(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SourceError(f"{path}: cannot open kernel log: {exc.strerror or exc}") from None


def _read_available_bytes(fd: int, path: Path, limit: int | None = None) -> tuple[bytes, int]:
    """Every record /dev/kmsg has for this descriptor now (at most about `limit` bytes: the next read goes on from
    there), and how many overwrites (EPIPE) were met.

    /dev/kmsg returns one record per read() and EAGAIN when caught up (non-blocking); a regular file
    (tests, a scenario) returns data until EOF."""
    chunks: list[bytes] = []
    lost = taken = 0
    while limit is None or taken < limit:
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
        taken += len(data)
    return b"".join(chunks), lost
