"""A saved kernel log of any size, read in flat memory at the speed of a substring search: the lines the kernel-log
checks read, as records (each with its exact line number), and nothing else.

What decides which lines: each kernel-log check states the fixed texts a line must hold for it to look at the line
(its KernelConsumer's ``interest``: "Xid" and "NVRM: GPU at " for xid, "SXid" and "NVSwitch" for nvswitch_sxid);
every other line is one they skip unread. So the file is read in fixed chunks into one reused buffer (not mmap: the
pages of a mapped file that are touched count in the process's memory), each chunk's complete lines are searched for
those texts with ``bytes.find`` (C), and only a line that holds one is decoded and parsed as a whole-file parse reads
it (agent/core/kernel_log.py parse_line; in a reader process, a part's lines with one findall of the pattern of their
form, kernel_log's DMESG_LINES, FORM_LINES or KMSG_ROW, built from the patterns parse_line reads them with; a part in
dmesg form is read in C where the package was built with it, agent/core/log_rows.py, and sent as columns). The
newlines between two such lines are counted for their line numbers, which are exact. The search looks first for one
rare byte of each text (``memchr``: X, V) and checks the text there; where that byte is common it searches for the
texts themselves (agent/core/line_search.py, in C, which the followed kernel log's reader shares).

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

Here: the scan and the taking of the parts in order. The search of the lines is agent/node/kernel_scan_lines.py's,
the reader processes agent/node/kernel_scan_readers.py's.
"""
from __future__ import annotations

import bisect
import codecs
import os
import stat
import threading
from dataclasses import field
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.kernel_log import (
    HEAD_CHARS,
    LogRecord,
    LogRecordBuilder,
    gc_paused,
    parse_line,
    stamp_usec,
)
from gpuwarden.agent.core.line_search import probes_for
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.node.kernel_scan_lines import MAX_NOTES, Rows, _read_lines, _read_part, stamp_texts
from gpuwarden.agent.node.kernel_scan_readers import HANDED_AHEAD, _NoFork, _parts, _Readers

CHUNK = 1 << 20  # bytes read at a time
LINE_MAX = 1 << 20  # bytes of one line that are read; the rest of a longer line is skipped
BATCH = 32768  # records handed to the checks' judges at a time ...
BATCH_BYTES = 8 << 20  # ... or fewer, when their lines add up to this
PART = 1 << 19  # bytes of a large file read by one process at a time: a part of XID lines only is ~1.5 MiB of rows
PARALLEL_MIN = 16 << 20  # bytes: a smaller file is read by this process alone
MAX_WORKERS = 4  # past a few readers the judging here, in order, is what takes the time


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
        # at use: +20 ms (-X importtime) before a large file's readers can start (agent/cli/analyze_ahead.py starts
        # them first); the checks, loaded while they read, import it anyway
        from gpuwarden.agent.core.passive import KernelBatch

        self._batch = KernelBatch
        self.consumers = consumers
        self.states: list[dict[str, Any]] = [{} for _ in consumers]
        self.findings: list[list[Any]] = [[] for _ in consumers]

    def judge(self, records: list[LogRecord]) -> None:
        for i, c in enumerate(self.consumers):
            j = c.judge(self.states[i], self._batch(records, [], None), c.defaults, 0.0, hold=False)
            self.states[i], self.findings[i] = j.state, list(j.findings)


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


# ---------------------------------------------------------------- a large file, read in parts by several processes
# (the reader processes themselves: agent/node/kernel_scan_readers.py)
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
    return threading.active_count()


class RowRecords(Sequence[LogRecord]):
    """A batch of the readers' records as they sent them (kernel_scan_lines.Rows: rows, or a dmesg part's columns,
    numbered from their part's first line): each record is made when it is asked for, and ``messages`` holds every
    record's message at once. A judge that reads the messages and only some records (the xid check: the first and
    last line of each text) makes only those; one that reads them all gets them all, the same as a list's."""

    __slots__ = ("messages", "_segments", "_starts", "_source", "_count")

    def __init__(self, source: str) -> None:
        self.messages: list[str] = []
        # (rows, or the columns with their numbers and ends as int64 views; lines before their part)
        self._segments: list[tuple[Any, int]] = []
        self._starts: list[int] = []  # index of each segment's first record
        self._source = source
        self._count = 0

    def add(self, rows: Rows, offset: int) -> None:
        self._starts.append(self._count)
        if type(rows) is tuple:  # columns
            messages, numbers, stamps, ends = rows
            self._segments.append(((messages, memoryview(numbers).cast("q"), stamps, memoryview(ends).cast("q")),
                                   offset))
            self.messages += messages
            self._count += len(messages)
        else:
            self._segments.append((rows, offset))
            self.messages += [r[0] for r in rows]
            self._count += len(rows)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("record index out of range")
        k = bisect.bisect_right(self._starts, i) - 1
        rows, offset = self._segments[k]
        j = i - self._starts[k]
        if type(rows) is tuple:
            messages, numbers, stamps, ends = rows
            message, line, seq, priority, timestamp, facility = messages[j], numbers[j], None, None, None, None
            usec = stamps[ends[j - 1] if j else 0:ends[j]].decode("ascii")
        else:
            message, line, seq, usec, priority, timestamp, facility = rows[j]
        if type(usec) is str:  # as the reader found it (see _text_rows): made a number only for a record made
            secs, _, frac = usec.partition(".")
            usec = stamp_usec(secs, frac) if frac else int(secs)
        if type(seq) is str:
            seq = int(seq)
        r = LogRecordBuilder(message, line + offset, self._source, seq, usec, priority, timestamp, facility)
        r.__class__ = LogRecord
        return r

    def __iter__(self) -> Iterator[LogRecord]:
        return (self[i] for i in range(self._count))


def _rows_count(rows: Rows) -> int:
    return len(rows[0]) if type(rows) is tuple else len(rows)


def _rows_slice(rows: Rows, at: int, stop: int) -> Rows:
    """rows[at:stop]; columns are made rows for it (a part holds more records than a batch only where its lines
    are a few bytes each)."""
    if type(rows) is tuple:
        messages, numbers, stamps, ends = rows
        rows = [(message, line, None, stamp, None, None, None) for message, line, stamp in
                zip(messages, memoryview(numbers).cast("q"), stamp_texts(stamps, ends), strict=True)]
    return rows[at:stop]


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
        count = _rows_count(rows)
        for at in range(0, count, BATCH):
            some = _rows_slice(rows, at, at + BATCH) if at or count > BATCH else rows
            records.add(some, offset)
            held += sum(map(len, records.messages[-_rows_count(some):]))
            if len(records) >= BATCH or held >= BATCH_BYTES:
                judges.judge(records)  # type: ignore[arg-type]  # a Sequence of LogRecords
                records = RowRecords(source)
                held = 0
        offset += lines
    judges.judge(records)  # type: ignore[arg-type]
    readers.wait()
    return _result(judges, errors, offset, blank, notes, source, cut, malformed, line_max)
