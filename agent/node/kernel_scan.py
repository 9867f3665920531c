"""A saved kernel log of any size, read in flat memory at the speed of a substring search: the lines the kernel-log
checks read, as records (each with its exact line number), and nothing else.

What decides which lines: each kernel-log check states the fixed texts a line must hold for it to look at the line
(its KernelConsumer's ``interest``: "Xid" and "NVRM: GPU at " for xid, "SXid" and "NVSwitch" for nvswitch_sxid);
every other line is one they skip unread. So the file is read in fixed chunks into one reused buffer (not mmap: the
pages of a mapped file that are touched count in the process's memory), each chunk's complete lines are searched for
those texts with ``bytes.find`` (C), and only a line that holds one is decoded and parsed as a whole-file parse reads
it (agent/core/kernel_log.py parse_line; in a reader process, a part's lines with one findall of the pattern of their
form, kernel_log's DMESG_LINES, FORM_LINES or KMSG_ROW, built from the patterns parse_line reads them with). The
newlines between two such lines are counted (``bytes.count``, C) for their line numbers, which are exact. The search
looks first for one rare byte of each text (``memchr``: X, V) and checks the text there; where that byte is common it
searches for the texts themselves (agent/core/line_search.py, which the followed kernel log's reader shares).

What is read is what a parse of the whole file reads, and so the findings are the same (tests/test_analyze_scan.py
compares both on every recorded log and on generated ones):
- the text is UTF-8 with undecodable bytes replaced, CRLF line ends read as LF (a lone CR stays in its line);
- a line is read up to LINE_MAX bytes: a longer one is read cut there (the checks read a driver line's first
  4096 characters; the driver's lines are a few hundred), and a note names it with its length;
- the format (raw kmsg or text) is voted by the file's first lines, as for a whole text (kernel_log.detect_format).
In a raw /dev/kmsg file, a malformed record is reported (a note with file:line) when it is a line the checks read
or the file's last line, where a cut-off write leaves one; malformed records elsewhere, which the checks would skip
anyway, are not looked for (a full parse validates every line at ~4x the cost).

A large file (a regular file of PARALLEL_MIN bytes or more, where this process may use more than one CPU and can
fork) is read by forked processes, one per CPU up to MAX_WORKERS: it is cut at line starts into parts of about PART
bytes, each read by whichever reader is free for it (a reader takes the next part's number from a pipe when it has
sent the last), which sends back (marshal, through a pipe of its own) the part's lines the checks read, parsed,
numbered from the part's first line, and its newline count. This process takes the parts in file order,
numbers their lines on from the parts before, and judges them as they come: the judges see the records a single
reader gives, in the same order (the tests compare both, with a part boundary at every line end). A reader that
fails (an exception, an exit, a signal) is a ScanError naming the file and the part's bytes, never a partial result.
The judging stays here, in order, because each check's judge carries its state from record to record.

Memory stays flat in the file's size: one buffer of CHUNK + LINE_MAX bytes in each reader, records judged in batches
of BATCH records or BATCH_BYTES of their lines (each check's judge carries its state from batch to batch, as the
daemon's does), notes capped at MAX_NOTES; with readers, at most one finished part per reader is held here ahead
of its turn besides the one being judged (the others wait in the readers' pipes of PIPE_SIZE bytes, and a reader
whose pipe is full waits).
"""
from __future__ import annotations

import bisect
import codecs
import gc
import marshal
import os
import re
import select
import signal
import stat
import struct
from dataclasses import field
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from gpuwarden.agent.core.errors import GpuwardenError, ParseError
from gpuwarden.agent.core.kernel_log import (
    DMESG_LINES,
    FORM_LINES,
    HEAD_CHARS,
    KMSG_ROW,
    PRIO_FACILITY,
    PRIO_LEVEL,
    LogRecord,
    LogRecordBuilder,
    classify_line,
    gc_paused,
    kmsg_line,
    parse_line,
    stamp_usec,
)
from gpuwarden.agent.core.line_search import ProbeMemory, Probes, lines_holding, probes_for
from gpuwarden.agent.core.records import dataclass

CHUNK = 1 << 20  # bytes read at a time
LINE_MAX = 1 << 20  # bytes of one line that are read; the rest of a longer line is skipped
BATCH = 4096  # records handed to the checks' judges at a time ...
BATCH_BYTES = 8 << 20  # ... or fewer, when their lines add up to this
MAX_NOTES = 1000  # malformed records, and lines read cut, named one by one; past this, counted
PART = 1 << 19  # bytes of a large file read by one process at a time: a part of XID lines only is ~1.5 MiB of rows
PARALLEL_MIN = 16 << 20  # bytes: a smaller file is read by this process alone
MAX_WORKERS = 4  # past a few readers the judging here, in order, is what takes the time
READER_NICE = 5  # the readers' niceness, above this process's
PIPE_SIZE = 1 << 20  # bytes a reader's pipe holds (Linux's default pipe-max-size)
# Part numbers handed to the readers past the part being judged, as many as their pipe takes (4 bytes each; a pipe
# holds 64 KiB): the readers do not wait for this process to hand them more while it is busy (loading the checks,
# or the CLI). What the readers read ahead is bounded by their result pipes, not by this.
HANDED_AHEAD = 1 << 14
# A byte that is text and no white space whatever the bytes around it (ASCII, and not one str.isspace takes): where
# one is found the lines are not blank, without a copy of them (a copy of a chunk is fresh pages each time).
_SURELY_TEXT = re.compile(rb"[^\t\n\x0b\x0c\r\x1c-\x1f \x80-\xff]").search


def read_head(f: BinaryIO, chars: int = HEAD_CHARS, have: bytes = b"") -> tuple[bytes, str]:
    """The file's first bytes, and their text: the first ``chars`` characters of the file's text (or all of it),
    exactly as a decode of the whole file begins. ``have``: its first bytes, read already. Reads at most
    4 * chars + 4 bytes in all."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    raw: list[bytes] = [have]
    text: list[str] = [decoder.decode(have)]
    got = len(text[0])
    while got < chars:
        piece = f.read(min(1 << 16, 4 * (chars - got) + 4))
        if not piece:
            text.append(decoder.decode(b"", final=True))
            break
        raw.append(piece)
        out = decoder.decode(piece)
        text.append(out)
        got += len(out)
    return b"".join(raw), "".join(text)[:chars]


@dataclass
class ScanResult:
    findings: list[Any]
    errors: list[ParseError]
    lines: int  # lines in the file (a last line without a newline counts)
    blank: bool  # nothing but white space in the file (or nothing at all)
    notes: list[str] = field(default_factory=list)  # lines read cut, malformed records past MAX_NOTES


class _Judges:
    """The kernel-log checks' judges fed in batches, each carrying its state (a post-mortem keeps every incident)."""

    def __init__(self, consumers: Sequence[Any]):
        from gpuwarden.agent.core.passive import KernelBatch

        self._batch = KernelBatch
        self.consumers = consumers
        self.states: list[dict[str, Any]] = [{} for _ in consumers]
        self.findings: list[list[Any]] = [[] for _ in consumers]

    def judge(self, records: list[LogRecord]) -> None:
        for i, c in enumerate(self.consumers):
            j = c.judge(self.states[i], self._batch(records, [], None), c.defaults, 0.0, hold=False)
            self.states[i], self.findings[i] = j.state, list(j.findings)


class ScanError(GpuwardenError):
    """The file was not read whole: a process reading a part of it failed. Names the file and the part."""


class _NoFork(Exception):
    """A reader process could not be started."""


def start_readers(f: BinaryIO, kmsg: bool, interest: Sequence[str], first: bytes = b"", chunk: int = CHUNK,
                  line_max: int = LINE_MAX, workers: int | None = None, part: int | None = None) -> _Readers | None:
    """The reader processes of a large file, started: they read ``f`` from where ``first`` was read from it, for
    the lines that hold one of the ``interest`` texts; scan(readers=) takes what they read. None where the file is
    read by one process (see scan). ``workers``, ``part``: as scan's."""
    needles = list(dict.fromkeys(t.encode() for t in interest))
    plan = _plan(f, first, workers, PART if part is None else part)
    if plan is None:
        return None
    parts, count = plan
    readers = _Readers(count, parts)
    try:
        readers.start(_read_part, f.fileno(), kmsg, needles, probes_for(needles), chunk + line_max, chunk, line_max)
    except _NoFork:  # no process to be had (a limit on them, no memory): read here, as a small file
        readers.close()
        return None
    except BaseException:
        readers.close()
        raise
    return readers


def scan(f: BinaryIO, source: str, kmsg: bool, consumers: Sequence[Any] | Callable[[], Sequence[Any]],
         first: bytes = b"", chunk: int = CHUNK, line_max: int = LINE_MAX, workers: int | None = None,
         part: int | None = None, interest: Sequence[str] | None = None,
         readers: _Readers | None = None) -> ScanResult:
    """Reads ``f`` (after ``first``, bytes already read from it) to its end; the findings of ``consumers``
    (KernelConsumers: their ``interest`` texts pick the lines, their judges decide) in their order.

    ``consumers`` may be a function that loads them, given the texts they read as ``interest``: a large file's
    readers then start while they load. ``workers``: processes that read parts of ``part`` bytes (PART if None)
    each; None: one per CPU this process may use, for a regular file of PARALLEL_MIN bytes or more; 1: read here.
    ``readers``: the file's readers, started already by start_readers with the same arguments (they are ended
    here, whatever the outcome)."""
    if interest is None:
        assert not callable(consumers), "the texts the consumers read come with a function that loads them"
        interest = [t for c in consumers for t in c.interest]
    if readers is None:
        readers = start_readers(f, kmsg, interest, first, chunk, line_max, workers, part)
    if readers is not None:
        try:
            judges = _Judges(consumers() if callable(consumers) else consumers)  # loaded while the readers read
            with gc_paused():  # records and incidents form no cycles: the collector would only re-walk them
                return _take_parts(readers, judges, source, line_max)
        finally:
            readers.close()
    needles = list(dict.fromkeys(t.encode() for t in interest))
    probes = probes_for(needles)
    judges = _Judges(consumers() if callable(consumers) else consumers)
    records: list[LogRecord] = []
    errors: list[ParseError] = []
    notes: list[str] = []
    malformed = cut = held = 0

    def hit(raw: bytes | bytearray, lineno: int) -> None:
        nonlocal malformed, held
        one = parse_line(raw.decode("utf-8", "replace"), lineno, source, kmsg)
        if one is None:
            return
        if type(one) is ParseError:
            malformed += 1
            if len(errors) < MAX_NOTES:
                errors.append(one)
            return
        records.append(one)  # type: ignore[arg-type]
        held += len(raw)
        if len(records) >= BATCH or held >= BATCH_BYTES:
            judges.judge(records)
            records.clear()
            held = 0

    def long_line(lineno: int, size: int) -> None:
        nonlocal cut
        cut += 1
        if cut <= MAX_NOTES:
            notes.append(_cut_note(source, lineno, size, line_max))

    lines, blank = _read_lines(_reader(f, first), needles, probes, kmsg, bytearray(chunk + line_max), chunk,
                               line_max, True, hit, long_line)
    judges.judge(records)
    return _result(judges, errors, lines, blank, notes, source, cut, malformed, line_max)


def _cut_note(source: str, lineno: int, size: int, line_max: int) -> str:
    return f"{source}:{lineno}: line of {size} bytes; its first {line_max} bytes read"


def _result(judges: _Judges, errors: list[ParseError], lines: int, blank: bool, notes: list[str], source: str,
            cut: int, malformed: int, line_max: int) -> ScanResult:
    if cut > MAX_NOTES:
        notes.append(f"{source}: {cut - MAX_NOTES} more line(s) longer than {line_max} bytes, read cut")
    if malformed > len(errors):
        notes.append(f"{source}: {malformed - len(errors)} more malformed kmsg record(s), not listed")
    return ScanResult([f for fs in judges.findings for f in fs], errors, lines, blank, notes)


def _reader(f: BinaryIO, first: bytes) -> Callable[[memoryview], int]:
    """readinto for ``first``, then the rest of ``f``."""
    pending = memoryview(first)
    read_into = f.readinto

    def read(into: memoryview) -> int:
        nonlocal pending
        if pending:
            n = min(len(into), len(pending))
            into[:n] = pending[:n]
            pending = pending[n:]
            return n
        return read_into(into) or 0

    return read


def _read_lines(read: Callable[[memoryview], int], needles: Sequence[bytes],
                probes: Probes, kmsg: bool, buf: bytearray, chunk: int,
                line_max: int, final: bool, hit: Callable[[bytes | bytearray, int], None],
                long_line: Callable[[int, int], None], memory: ProbeMemory | None = None,
                gather: Callable[[bytes, list[int]], None] | None = None) -> tuple[int, bool]:
    """Reads lines from ``read`` to its end: each line that holds one of ``needles`` goes to ``hit`` with its line
    number (counted from 1 at the first byte read), each line longer than ``line_max`` to ``long_line`` (its
    number, its length). ``final``: the end read is the file's end (in raw kmsg its last line is read in any case).
    ``buf``, of chunk + line_max bytes, is where they are read; ``memory``, what earlier reads of the same log taught
    of the probes (one is made for this read otherwise). ``gather``: if given, a buffer's lines go to it at once
    instead of one by one to ``hit``, joined by newlines (CRs of CRLF ends taken off) with their numbers: a step of
    Python less per line, where the lines are many. Returns (lines read, nothing but white space)."""
    view = memoryview(buf)
    lines = 0  # newlines before buf[0]
    have = 0  # bytes of a partial line at the front of buf
    blank = True
    last: tuple[int, bytes] | None = None  # the last complete line: (line number, bytes)
    count, rfind = buf.count, buf.rfind
    memory = memory if memory is not None else ProbeMemory()

    def lines_of(start: int, stop: int) -> None:
        """Reads the complete lines buf[start:stop] (stop just past a newline)."""
        nonlocal lines, last, blank
        at = start
        spans = lines_holding(buf, start, stop, probes, memory)
        if gather is not None:
            if spans:
                numbers = []
                for ls, _ in spans:
                    lines += count(b"\n", at, ls)
                    at = ls
                    numbers.append(lines + 1)
                joined = b"\n".join([buf[ls:le] for ls, le in spans])
                if b"\r" in joined:
                    joined = joined.replace(b"\r\n", b"\n").removesuffix(b"\r")
                gather(joined, numbers)
        else:
            for ls, le in spans:
                lines += count(b"\n", at, ls)
                at = ls
                hit(buf[ls:le - 1] if le > ls and buf[le - 1] == 13 else buf[ls:le], lines + 1)
        lines += count(b"\n", at, stop)
        if final:
            ls = rfind(b"\n", start, stop - 1) + 1 or start
            last = (lines, bytes(buf[ls:stop - 1]))
        if blank and (_SURELY_TEXT(buf, start, stop) or (
                buf[start:stop].strip() and not buf[start:stop].decode("utf-8", "replace").isspace())):
            blank = False

    while True:
        n = read(view[have:have + chunk])
        end = have + n
        if n == 0:
            break
        nl = rfind(b"\n", 0, end)
        if nl < 0:
            have = end
            if have >= line_max:
                head, size, have = _long_line(buf, line_max, have, read, chunk)
                lines += 1
                long_line(lines, size)
                if any(t in head for t in needles):  # read, as any line, only if it holds a text the checks read
                    hit(head, lines)
                last = None  # the long line was read as a line of its own
                if blank and head.strip() and not head.decode("utf-8", "replace").isspace():
                    blank = False
                nl = rfind(b"\n", 0, have)
                if nl >= 0:  # whole lines read with the long line's end: read now, the file may end here
                    lines_of(0, nl + 1)
                    buf[0:have - nl - 1] = buf[nl + 1:have]
                    have -= nl + 1
            continue
        lines_of(0, nl + 1)
        have = end - nl - 1
        buf[0:have] = buf[nl + 1:end]
    if have:  # a last line without a newline: read if it holds a text, and in raw kmsg in any case
        tail = bytes(buf[:have])
        lines += 1
        if blank and tail.strip() and not tail.decode("utf-8", "replace").isspace():
            blank = False
        if kmsg or any(t in tail for t in needles):
            hit(tail, lines)
    elif final and kmsg and last is not None and last[1] and not any(t in last[1] for t in needles):
        # The file's last line, if it holds no text (then it was read already): a record cut off by a write that
        # did not finish is found there.
        hit(last[1][:-1] if last[1].endswith(b"\r") else last[1], last[0])
    return lines, blank


def _long_line(buf: bytearray, line_max: int, have: int, read: Callable[[memoryview], int],
               chunk: int) -> tuple[bytes, int, int]:
    """A line longer than line_max, whose first ``have`` bytes are at the front of buf: (its first line_max bytes,
    its length, the bytes after its newline, now at the front of buf). The rest of the line is read and skipped."""
    head = bytes(buf[:line_max])
    size = have
    view = memoryview(buf)
    while True:
        n = read(view[0:chunk])
        if n == 0:
            return head, size, 0
        nl = buf.find(b"\n", 0, n)
        if nl >= 0:
            buf[0:n - nl - 1] = buf[nl + 1:n]
            return head, size + nl, n - nl - 1
        size += n


# ---------------------------------------------------------------- a large file, read in parts by several processes
# The search and the newline count of a large file are split over the CPUs: the file is cut at line starts into
# parts of about PART bytes and forked processes read them, each sending back one part's lines the checks read,
# parsed, with line numbers counted from the part's start. A reader takes its next part when it has sent the last
# (a part's number from a pipe this process writes them to, in file order), so a reader that gets less of a CPU
# (the judging here shares one with it) reads fewer parts and they all end together. This process takes the parts
# in file order, adds the lines before each part to its numbers and judges the records as they come: the judges see
# exactly the records, in the order, that one reader gives them. In this process's memory at any time: at most one
# finished part per reader, read ahead of its turn, and the one being judged (the rest wait in the readers' pipes,
# which stop a reader when full).

def _plan(f: BinaryIO, first: bytes, workers: int | None, part: int) -> tuple[list[tuple[int, int]], int] | None:
    """The parts (start, stop byte offsets) of the file from where ``first`` was read, and the processes to read
    them; None to read it here (not a regular file, no fork, one CPU, a small file)."""
    if workers == 1 or not (hasattr(os, "fork") and hasattr(os, "preadv")):
        return None
    try:
        fd = f.fileno()
        st = os.fstat(fd)
        base = f.tell() - len(first)
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return None
    if not stat.S_ISREG(st.st_mode) or base < 0:
        return None
    if workers is None:
        if st.st_size - base < PARALLEL_MIN or _threads() > 1:  # a fork copies only the calling thread
            return None
        workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                      MAX_WORKERS)
    parts = _parts(fd, base, st.st_size, max(1, part))
    workers = min(workers, len(parts))
    return (parts, workers) if workers > 1 else None


def _threads() -> int:
    import threading

    return threading.active_count()


def _parts(fd: int, start: int, size: int, part: int) -> list[tuple[int, int]]:
    """[start, size) cut at line starts into pieces of at least ``part`` bytes (a line is never cut)."""
    parts = []
    while start < size:
        stop = start + part
        if stop < size:
            stop = _line_start(fd, stop - 1, size)
        stop = min(stop, size)
        parts.append((start, stop))
        start = stop
    return parts


def _line_start(fd: int, at: int, size: int) -> int:
    """The offset just past the first newline at or after ``at`` (``size`` if there is none before it)."""
    step = 512  # a kernel log's lines are short: most boundaries are found in the first read
    while at < size:
        data = os.pread(fd, min(step, size - at), at)
        step = min(step * 4, 1 << 16)
        if not data:
            break
        nl = data.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(data)
    return size


_PART_NO = struct.Struct("<i")  # a part's number in the pipe the readers take them from: 4 bytes, read atomically
_HELD = struct.Struct("<q")  # a reader's slot in the shared page: the part it reads now, -1 between parts


class _Readers:
    """The reader processes of one file: started, handed parts, their results taken in file order, ended."""

    def __init__(self, workers: int, parts: list[tuple[int, int]]) -> None:
        import mmap

        self.parts = parts
        self.source = "?"  # the file's name in errors: set by the scan that takes the parts
        self.procs: list[tuple[int, int]] = []  # (pid, read end of its pipe), in the order started
        self.ended: dict[int, int] = {}  # pid -> wait status
        self.ahead: list[tuple[Any, ...] | None] = []  # per reader: its next message, read before its turn
        self.claims_r, self.claims_w = os.pipe()
        self.handed = 0  # parts whose number is in the pipe
        # What each reader reads now, where this process sees it without a message: a reader killed in a part is
        # named with that part's bytes.
        self.held = mmap.mmap(-1, _HELD.size * workers)
        self.held.write(_HELD.pack(-1) * workers)
        self.workers = workers

    def start(self, read_part: Callable[..., tuple[Any, ...]], *args: Any) -> None:
        for w in range(self.workers):
            r, wr = os.pipe()
            _widen(wr)
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(r)
                os.close(wr)
                raise _NoFork from exc
            if pid == 0:  # the reader: never returns
                try:
                    os.close(r)
                    os.close(self.claims_w)
                    for _, other in self.procs:
                        os.close(other)
                    _reader_process(self.claims_r, wr, self.held, w, self.parts, read_part, args)
                finally:
                    os._exit(1)  # reached only if the reader could not start: the parent says so
            os.close(wr)
            self.procs.append((pid, r))
            self.ahead.append(None)
        os.close(self.claims_r)
        self.claims_r = -1
        os.set_blocking(self.claims_w, False)
        self.hand_out(HANDED_AHEAD)

    def hand_out(self, upto: int) -> None:
        """Puts the numbers of the parts before ``upto`` in the readers' pipe, as many as it takes now (the rest at a
        later call); closes it after the last part's."""
        upto = min(upto, len(self.parts))
        while self.handed < upto:
            # At most PIPE_BUF bytes a write: all of it goes in or none (no number cut), and a full pipe is not
            # waited for (the readers are busy then; it is filled again when the next part is taken).
            stop = min(upto, self.handed + select.PIPE_BUF // _PART_NO.size)
            try:
                os.write(self.claims_w, b"".join(_PART_NO.pack(i) for i in range(self.handed, stop)))
            except BlockingIOError:
                return
            self.handed = stop
        if self.handed == len(self.parts) and self.claims_w >= 0:
            os.close(self.claims_w)  # a reader that asks for another part now ends
            self.claims_w = -1

    def take(self, i: int) -> tuple[Any, ...]:
        """Part i's result, from whichever reader read it (the parts before it taken already)."""
        while True:
            for w, got in enumerate(self.ahead):
                if got is not None and got[1] == i:
                    self.ahead[w] = None
                    return got[2]
            waiting = select.poll()
            fds = {}
            for w, (pid, r) in enumerate(self.procs):
                if self.ahead[w] is None and pid not in self.ended:
                    waiting.register(r, select.POLLIN)
                    fds[r] = w
            if not fds:  # every reader ended and none read it: not a result to give
                self._failed(i, "no reader read it")
            for r, _ in waiting.poll():
                self._next(fds[r], i)

    def _next(self, w: int, waited: int) -> None:
        """Reads reader w's next message (a part's result), or learns that it ended."""
        pid, r = self.procs[w]
        got = _receive(r)
        if got is not None and got[0] == "part":
            self.ahead[w] = got
            return
        held = _HELD.unpack_from(self.held, _HELD.size * w)[0]
        if got is not None:  # ("error", part, what): it raised
            self._failed(got[1] if got[1] >= 0 else waited, got[2])
        status = self.ended[pid] = os.waitpid(pid, 0)[1]
        if status or held >= 0:  # it ended in a part, or not as a reader ends
            self._failed(held if held >= 0 else waited, _status_text(status))

    def _failed(self, i: int, why: str) -> None:
        start, stop = self.parts[i]
        raise ScanError(f"{self.source}: reading bytes {start}-{stop} failed ({why}); the file was not read whole")

    def wait(self) -> None:
        """Each reader's end, once every part is taken: a reader that failed after its parts is an error too."""
        for pid, _ in self.procs:
            if pid not in self.ended:
                self.ended[pid] = os.waitpid(pid, 0)[1]
            if self.ended[pid]:
                raise ScanError(f"{self.source}: a process reading it failed after its parts "
                                f"({_status_text(self.ended[pid])})")

    def close(self) -> None:
        for fd in (self.claims_r, self.claims_w):
            if fd >= 0:
                os.close(fd)
        self.claims_r = self.claims_w = -1
        for pid, r in self.procs:
            os.close(r)
            if pid not in self.ended:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except OSError:
                    pass
        self.held.close()


class RowRecords(Sequence[LogRecord]):
    """A batch of the readers' records as they sent them (rows, numbered from their part's first line): each record
    is made when it is asked for, and ``messages`` holds every record's message at once. A judge that reads the
    messages and only some records (the xid check: the first and last line of each text) makes only those; one
    that reads them all gets them all, the same as a list's."""

    __slots__ = ("messages", "_rows", "_offsets", "_starts", "_source")

    def __init__(self, source: str) -> None:
        self.messages: list[str] = []
        self._rows: list[tuple[Any, ...]] = []
        self._offsets: list[int] = []  # lines before each segment's part
        self._starts: list[int] = []  # index of each segment's first row
        self._source = source

    def add(self, rows: list[tuple[Any, ...]], offset: int) -> None:
        self._starts.append(len(self._rows))
        self._offsets.append(offset)
        self._rows += rows
        self.messages += [r[0] for r in rows]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._rows)))]
        if i < 0:
            i += len(self._rows)
        message, line, seq, usec, priority, timestamp, facility = self._rows[i]
        if type(usec) is str:  # as the reader found it (see _text_rows): made a number only for a record made
            secs, _, frac = usec.partition(".")
            usec = stamp_usec(secs, frac) if frac else int(secs)
        if type(seq) is str:
            seq = int(seq)
        offset = self._offsets[bisect.bisect_right(self._starts, i) - 1]
        r = LogRecordBuilder(message, line + offset, self._source, seq, usec, priority, timestamp, facility)
        r.__class__ = LogRecord
        return r

    def __iter__(self) -> Iterator[LogRecord]:
        return (self[i] for i in range(len(self._rows)))


def _take_parts(readers: _Readers, judges: _Judges, source: str, line_max: int) -> ScanResult:
    """The readers' results, part by part in file order, numbered on and judged."""
    readers.source = source
    records = RowRecords(source)
    errors: list[ParseError] = []
    notes: list[str] = []
    malformed = cut = held = 0
    offset = 0  # lines before the part
    blank = True
    for i in range(len(readers.parts)):
        rows, errs, part_malformed, cuts, part_cut, lines, part_blank = readers.take(i)
        readers.hand_out(i + 1 + HANDED_AHEAD)
        for what, line in errs:
            if len(errors) < MAX_NOTES:
                errors.append(ParseError(what, source, line + offset))
        malformed += part_malformed
        for line, size in cuts:
            cut += 1
            if cut <= MAX_NOTES:
                notes.append(_cut_note(source, line + offset, size, line_max))
        cut += part_cut - len(cuts)
        blank = blank and part_blank
        for at in range(0, len(rows), BATCH):
            some = rows[at:at + BATCH] if at or len(rows) > BATCH else rows
            records.add(some, offset)
            held += sum(map(len, records.messages[-len(some):]))
            if len(records) >= BATCH or held >= BATCH_BYTES:
                judges.judge(records)  # type: ignore[arg-type]  # a Sequence of LogRecords
                records = RowRecords(source)
                held = 0
        offset += lines
    judges.judge(records)  # type: ignore[arg-type]
    readers.wait()
    return _result(judges, errors, offset, blank, notes, source, cut, malformed, line_max)


def _widen(fd: int) -> None:
    """A pipe that holds a part's result: its reader goes on to its next part while this process judges."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (ImportError, AttributeError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size: the default
        pass


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"its reader was killed by signal {os.WTERMSIG(status)}"
    return f"its reader exited with status {os.WEXITSTATUS(status)}"


def _reader_process(claims: int, out: int, held: Any, slot: int, parts: list[tuple[int, int]],
                    read_part: Callable[..., tuple[Any, ...]], args: tuple[Any, ...]) -> None:
    """A forked reader: takes the number of a part from ``claims``, reads the part, sends its result, until the
    pipe ends; exits without returning (nothing of the parent's, its buffers or exit handlers, runs twice)."""
    code = 1
    i = -1
    try:
        gc.disable()  # the rows hold only str, int and None: no cycles to collect
        # This process judges every part in order and is the one the readers wait for: where CPUs are short, it
        # runs first and the readers fill the time it leaves.
        os.nice(READER_NICE)
        fd, kmsg, needles, probes, buf_size, chunk, line_max = args
        buf = bytearray(buf_size)  # one for every part: a buffer this size anew is fresh pages each time
        memory = ProbeMemory()  # the parts are one log's: what one taught of its probe bytes holds for the next
        at = _HELD.size * slot
        last = len(parts) - 1
        while number := os.read(claims, _PART_NO.size):
            i = _PART_NO.unpack(number)[0]
            held[at:at + _HELD.size] = _HELD.pack(i)
            start, stop = parts[i]
            result = read_part(fd, start, stop, i == last, kmsg, needles, probes, buf, chunk, line_max, memory)
            _send(out, ("part", i, result))
            held[at:at + _HELD.size] = _HELD.pack(-1)
            i = -1
        code = 0
    except BaseException as exc:  # noqa: BLE001  # any failure is reported to the parent, which names the file
        try:
            _send(out, ("error", i, f"{type(exc).__name__}: {exc}"))
        except BaseException:  # noqa: BLE001  # the parent is gone or the pipe is broken: the exit status says it
            pass
    finally:
        os._exit(code)


def _read_part(fd: int, start: int, stop: int, final: bool, kmsg: bool, needles: Sequence[bytes],
               probes: Probes, buf: bytearray, chunk: int,
               line_max: int, memory: ProbeMemory | None = None) -> tuple[Any, ...]:
    """One part's result: (rows of the records, malformed kmsg records (what, line), their count, lines read cut
    (line, length), their count, lines, blank); line numbers from 1 at the part's first line (the file's name and
    the lines before the part are put to them where the parts are taken)."""
    rows: list[tuple[Any, ...]] = []
    errs: list[tuple[str, int]] = []
    cuts: list[tuple[int, int]] = []
    counts = [0, 0]  # malformed, cut
    at = start

    def read(into: memoryview) -> int:
        nonlocal at
        room = min(len(into), stop - at)
        if room <= 0:
            return 0
        n = os.preadv(fd, [into[:room]], at)
        if n <= 0:
            raise OSError(f"the file ended at byte {at}, before {stop}: it changed while it was read")
        at += n
        return n

    # The lines the checks read, in pieces of newline-joined lines, and their numbers: parsed together.
    raws: list[bytes | bytearray] = []
    linenos: list[int] = []

    def hit(raw: bytes | bytearray, lineno: int) -> None:
        raws.append(raw)
        linenos.append(lineno)

    def gather(joined: bytes, numbers: list[int]) -> None:
        raws.append(joined)
        linenos.extend(numbers)

    def long_line(lineno: int, size: int) -> None:
        counts[1] += 1
        if len(cuts) < MAX_NOTES:
            cuts.append((lineno, size))

    lines, blank = _read_lines(read, needles, probes, kmsg, buf, chunk, line_max, final, hit, long_line, memory,
                               gather)
    if raws:
        if kmsg:
            _kmsg_rows(raws, linenos, rows, errs, counts)
        else:
            _text_rows(raws, linenos, rows)
    return rows, errs, counts[0], cuts, counts[1], lines, blank


def _text_rows(raws: list[bytes | bytearray], linenos: list[int], rows: list[tuple[Any, ...]]) -> None:
    """The rows of a text file's lines, as parse_line's text branch reads them: the lines in the part's form (its
    first line's: dmesg, dmesg -T, ISO, syslog/journal) read by one findall of kernel_log's pattern of that form
    over them all, any other line through classify_line: one pattern over the part's lines instead of several
    matches and a function call for each line."""
    text = b"\n".join(raws).decode("utf-8", "replace")
    # One object for each text that repeats (a flood's lines do): marshal sends it once and refers to it after, and
    # the judges here find the hash of a text they look up already made. A stamp goes as its text ("secs.frac"):
    # RowRecords makes it a number for the records a judge asks for, most of a flood's never are.
    same: dict[str, str] = {}
    form = classify_line(text[:text.find("\n")] if "\n" in text else text)[0]
    lines = FORM_LINES.get({"journal": "dmesg-ctime", "journal-iso": "dmesg-iso"}.get(form, form))
    # A line holds no newline, so each is one match (zip's strict= would say otherwise, and the part fail whole).
    if lines is None:
        for (secs, frac, message), lineno in zip(DMESG_LINES.findall(text), linenos, strict=True):
            if secs:
                rows.append((same.setdefault(message, message), lineno, None, f"{secs}.{frac}", None, None, None))
            elif message and not message.isspace():
                _, message, timestamp, usec, priority, seq = classify_line(message)
                rows.append((message, lineno, seq, usec, priority, timestamp, None))
        return
    for (timestamp, secs, frac, message), lineno in zip(lines.findall(text), linenos, strict=True):
        if timestamp:
            rows.append((same.setdefault(message, message), lineno, None, f"{secs}.{frac}" if secs else None, None,
                         timestamp, None))
        elif message and not message.isspace():
            _, message, timestamp, usec, priority, seq = classify_line(message)
            rows.append((message, lineno, seq, usec, priority, timestamp, None))


def _kmsg_rows(raws: list[bytes | bytearray], linenos: list[int], rows: list[tuple[Any, ...]],
               errs: list[tuple[str, int]], counts: list[int]) -> None:
    """The rows of a raw kmsg file's lines, as parse_line's kmsg branch reads them: the well-formed records by one
    findall of KMSG_ROW over them all, any other line (a malformed record, one past the pattern's bounds) through
    kmsg_line, the exact test."""
    read = KMSG_ROW.findall(b"\n".join(raws).decode("utf-8", "replace"))
    same: dict[str, str] = {}
    for (prio, seq, usec, message), lineno in zip(read, linenos, strict=True):
        if prio:
            try:
                level, facility = PRIO_LEVEL[prio], PRIO_FACILITY[prio]
            except KeyError:  # "0006", or a prio past the 24 facilities: still a number
                level, facility = int(prio) & 7, int(prio) >> 3
            rows.append((same.setdefault(message, message), lineno, seq, usec, level, None, facility))  # as text
        elif message and message[0] != " ":
            one = kmsg_line(message, "", lineno)
            if type(one) is ParseError:
                counts[0] += 1
                if len(errs) < MAX_NOTES:
                    errs.append((one.what, lineno))
            else:
                rows.append((one.message, lineno, one.seq, one.usec, one.priority, one.timestamp, one.facility))


_HEADER = struct.Struct("<Q")


def _send(fd: int, message: tuple[Any, ...]) -> None:
    body = marshal.dumps(message)
    for data in (memoryview(_HEADER.pack(len(body))), memoryview(body)):  # not joined: a copy of a part's result
        while data:
            data = data[os.write(fd, data):]


def _receive(fd: int) -> Any:
    """One message, or None if the writer ended before it was whole."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(head)[0])
    return None if body is None else marshal.loads(body)


def _read_exactly(fd: int, n: int) -> bytearray | None:
    got = bytearray(n)
    view = memoryview(got)
    at = 0
    while at < n:
        k = os.readv(fd, [view[at:]])
        if not k:
            return None
        at += k
    return got
