"""The kernel log: /dev/kmsg live (records since boot, non-blocking), a plain file on a recorded node.

The cursor (last sequence number + boot_id) is what the daemon persists so a restart neither misses
nor repeats a record; `KmsgFollower` honours it. A record's identity is (boot_id, seq): where a saved cursor
disagrees with the records the store says were counted, those win (`resume_cursor`), and a cursor ahead of the
kernel's newest record of its boot is taken back to it once the log has been read (`KmsgFollower.ahead`).
"""
from __future__ import annotations

import copy
import errno
import os
import re
import select
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ParseError, SourceError
from gpuwarden.agent.core.kernel_log import (
    KMSG_ROW,
    KmsgBatch,
    LogRecord,
    kmsg_line,
    kmsg_record,
    parse_kmsg_filtered,
    parse_kmsg_text,
)
from gpuwarden.agent.core.line_search import ProbeMemory, lines_holding, probes_for
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.inotify import FolderWaiter

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
_MAX_LINE = 1 << 16  # a "line" this long without a newline is not a kmsg record: reported and skipped
log = logs.get_logger("gpuwarden.kmsg")


@dataclass(frozen=True)
class Cursor:
    boot_id: str | None
    seq: int


def resume_cursor(saved: object, counted: "tuple[str | None, int] | None", boot_id: str | None) -> Cursor | None:
    """Where the follower of boot `boot_id` resumes at a start: after the records counted (`counted`, the store's
    (boot_id, seq) up to which every record was handed to the consumers, written with their counts), whatever the
    saved cursor (`saved`, meta kmsg_cursor) says: a cursor edited or rolled back would lose or repeat records.
    Only where nothing was counted is the saved cursor used (a store that has no such row). None: the boot's log
    from its start (nothing saved, or another boot's)."""
    cursor = _as_cursor(saved)
    if saved is not None and cursor is None:
        log.warning("kernel-log cursor in the state store is not a cursor; ignored", cursor=repr(saved)[:200])
    if counted is not None:
        known = Cursor(*counted)
        if cursor is not None and cursor != known:
            log.warning("kernel-log cursor disagrees with the records counted; resuming after the records counted "
                        "(a record is counted once, by boot id and seq)", cursor_boot_id=cursor.boot_id,
                        cursor_seq=cursor.seq, counted_boot_id=known.boot_id, counted_seq=known.seq)
        return known if known.boot_id == boot_id else None
    return cursor if cursor is not None and cursor.boot_id == boot_id else None


def _as_cursor(saved: object) -> Cursor | None:
    if not isinstance(saved, dict) or set(saved) != {"boot_id", "seq"}:
        return None
    boot_id, seq = saved["boot_id"], saved["seq"]
    if (boot_id is not None and not isinstance(boot_id, str)) or type(seq) is not int:
        return None
    return Cursor(boot_id, seq)


class Interest:
    """What the kernel-log consumers read: a message is kept when it holds one of `needles`. Callable on a message
    (the record-by-record filter); the follower searches the raw bytes it reads for the needles instead, so that only
    the lines holding one (and malformed lines, which are reported) are decoded and parsed."""

    def __init__(self, needles: "tuple[str, ...] | list[str]"):
        self.needles = tuple(dict.fromkeys(needles))
        # One compiled alternation: measured ~3x faster per message than any() over the substrings.
        self._search = re.compile("|".join(re.escape(n) for n in self.needles)).search
        # An ASCII needle is found in the bytes exactly where it is in the decoded text (a byte below 0x80 is never
        # part of a UTF-8 sequence, nor swallowed by a replacement); a needle that is not ASCII turns the byte scan off.
        self.raw = tuple(n.encode() for n in self.needles) if all(n.isascii() and n for n in self.needles) else None
        self.probes = probes_for(self.raw) if self.raw is not None else None  # how the follower finds them

    def __call__(self, message: str) -> object:
        return self._search(message)


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
            records, errors = _unnumbered(records, errors)
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
            first = _first_seq(text, last) if last is not None else None
            if self.log.live:
                records, errors = _unnumbered(records, errors)
            else:
                records, errors = _numbered_from(self._file_lines, records, errors)
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
        scan = _Scan(self.log.name, self.keep, self._probe_memory, numbered=False)
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
        scan = _Scan(self.log.name, self.keep, self._probe_memory, lines=self._file_lines)
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

    def _piece(self, scan: "_Scan", data: bytes) -> None:
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
        if len(self._pending) > _MAX_LINE:
            scan.too_long(self._pending)
            self._pending, self._skipping = b"", True


# The header KMSG_ROW takes as a record, after a newline that starts a line it would not take (and that is neither
# blank nor a " KEY=value" continuation): the lines the exact per-line test must see. A literal first byte: the
# search runs at C speed over a piece and, on a well-formed log, finds nothing.
_HEADER = rb"[0-9]{1,10}+,[0-9]{1,20}+,[0-9]{1,20}+,[\x00-\t\x0b-:<-\x7f]{0,30}+;"
_ODD_AFTER_NL = re.compile(rb"\n(?!" + _HEADER + rb"| |\n)")
_HEADER_AT = re.compile(_HEADER)


class _Scan:
    """The kmsg records of complete lines, piece after piece, building only those a consumer reads: the lines that
    hold one of the interest's needles, found with bytes.find, and the lines whose header is not the usual shape
    (malformed, or well-formed past the fast pattern's bounds), found with one search; only those lines are decoded
    and parsed, each exactly as parse_kmsg_filtered parses it. Line numbers go on from `lines` (the file's lines
    before these); `numbered` False (live /dev/kmsg, no file): records and errors carry no line."""

    def __init__(self, source: str, keep: Interest, memory: ProbeMemory | None = None, lines: int = 0,
                 numbered: bool = True):
        self.source, self.keep, self.probes, self.memory = source, keep, keep.probes or (), memory
        self.numbered = numbered
        self.records: list[LogRecord] = []
        self.errors: list[ParseError] = []
        self.last: int | None = None
        self.first: int | None = None
        self.lines = lines

    def feed(self, buf: bytes, end: int) -> None:
        """The complete lines buf[:end] (end just after a newline)."""
        if buf.find(b"\r", 0, end) >= 0:  # as parse_kmsg_filtered: CRLF line ends read as LF
            buf = buf[:end].replace(b"\r\n", b"\n")
            end = len(buf)
        if self.first is None:
            self.first = _seq_of(buf)
        starts = {line for line, _ in lines_holding(buf, 0, end, self.probes, self.memory)}
        find = buf.find
        if not _HEADER_AT.match(buf, 0, end) and buf[:1] not in (b" ", b"\n"):
            starts.add(0)
        starts.update(m.start() + 1 for m in _ODD_AFTER_NL.finditer(buf, 0, end - 1))
        lines, prev = self.lines, 0
        for start in sorted(starts):
            lines += buf.count(b"\n", prev, start)
            prev = start
            record = self._line(buf[start:find(b"\n", start, end)], lines + 1 if self.numbered else None)
            if record is not None and self.keep(record.message):
                self.records.append(record)
        self.lines = lines + buf.count(b"\n", prev, end)
        self._last_seq(buf, end)

    def _line(self, raw: bytes, lineno: int | None) -> LogRecord | None:
        """The record of one line (decoded as the whole text would be); a malformed one is kept in `errors`."""
        prio, seq, usec, message = KMSG_ROW.match(raw.decode(errors="replace")).groups(default="")
        if prio:
            return kmsg_record(message, lineno, self.source, prio, seq, usec)
        if not message or message[0] == " ":
            return None  # blank, or a record's " KEY=value" continuation
        one = kmsg_line(message, self.source, lineno)
        if type(one) is ParseError:
            self.errors.append(one)
            return None
        return one

    def _last_seq(self, buf: bytes, end: int) -> None:
        """The seq of the last well-formed record of the piece (walking back over blank, continuation and malformed
        lines), kept or not: the follower's cursor moves past every record read."""
        stop = end - 1  # the newline ending the last line
        while stop >= 0:
            start = buf.rfind(b"\n", 0, stop) + 1
            prio, seq, _usec, message = KMSG_ROW.match(buf[start:stop].decode(errors="replace")).groups(default="")
            if prio:
                self.last = int(seq)
                return
            if message and message[0] != " ":
                one = kmsg_line(message, self.source, 0)
                if type(one) is not ParseError:
                    self.last = one.seq
                    return
            stop = start - 1

    def too_long(self, head: bytes) -> None:
        self.lines += 1
        self.errors.append(ParseError(f"a line of more than {_MAX_LINE} bytes without a newline is not a kmsg "
                                      f"record; skipped: {head[:60].decode(errors='replace')!r}...",
                                      self.source, self.lines if self.numbered else None))


def _unnumbered(records: list[LogRecord], errors: list[ParseError]) -> tuple[list[LogRecord], list[ParseError]]:
    """Live /dev/kmsg's records and errors with no line: a count of what one read returned is no file's line."""
    return ([replace(r, line=None) for r in records],
            [ParseError(e.what, e.source, None) for e in errors])


def _numbered_from(before: int, records: list[LogRecord],
                   errors: list[ParseError]) -> tuple[list[LogRecord], list[ParseError]]:
    """Records and errors of a text that starts after the file's first `before` lines, numbered as the file's."""
    if not before:
        return records, errors
    return ([replace(r, line=r.line + before) if r.line is not None else r for r in records],
            [ParseError(e.what, e.source, e.line + before if e.line is not None else None) for e in errors])


def _seq_of(buf: bytes) -> int | None:
    try:
        return int(buf[:buf.find(b"\n")].split(b",", 2)[1])
    except (IndexError, ValueError):
        return None


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
