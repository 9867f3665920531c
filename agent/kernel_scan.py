"""A saved kernel log of any size, read in flat memory at the speed of a substring search: the lines the kernel-log
checks read, as records (each with its exact line number), and nothing else.

What decides which lines: each kernel-log check states the fixed texts a line must hold for it to look at the line
(its KernelConsumer's ``interest``: "NVRM: " for xid, "SXid" and "NVSwitch" for nvswitch_sxid); every other line
is one they skip unread. So the file is read in fixed chunks into one reused buffer (not mmap: the pages of a
mapped file that are touched count in the process's memory), each chunk's complete lines are searched for those
texts with ``bytes.find`` (C), and only a line that holds one is decoded and parsed, with the same per-line parser
a whole-file parse uses (agent/kernel_log.py parse_line). The newlines between two such lines are counted
(``bytes.count``, C) for their line numbers, which are exact. The search looks first for one rare byte of each text
(``memchr``: X, V) and checks the text there; where that byte is common it searches for the texts themselves.

What is read is what a parse of the whole file reads, and so the findings are the same (tests/test_analyze_scan.py
compares both on every recorded log and on generated ones):
- the text is UTF-8 with undecodable bytes replaced, CRLF line ends read as LF (a lone CR stays in its line);
- a line is read up to LINE_MAX bytes: a longer one is read cut there (the checks read a driver line's first
  4096 characters; the driver's lines are a few hundred), and a note names it with its length;
- the format (raw kmsg or text) is voted by the file's first lines, as for a whole text (kernel_log.detect_format).
In a raw /dev/kmsg file, a malformed record is reported (a note with file:line) when it is a line the checks read
or the file's last line, where a cut-off write leaves one; malformed records elsewhere, which the checks would skip
anyway, are not looked for (a full parse validates every line at ~4x the cost).

Memory stays flat in the file's size: one buffer of CHUNK + LINE_MAX bytes, records judged in batches of BATCH
records or BATCH_BYTES of their lines (each check's judge carries its state from batch to batch, as the daemon's
does), notes capped at MAX_NOTES.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Sequence

from .errors import ParseError
from .kernel_log import HEAD_CHARS, LogRecord, parse_line

CHUNK = 1 << 20  # bytes read at a time
LINE_MAX = 1 << 20  # bytes of one line that are read; the rest of a longer line is skipped
BATCH = 4096  # records handed to the checks' judges at a time ...
BATCH_BYTES = 8 << 20  # ... or fewer, when their lines add up to this
MAX_NOTES = 1000  # malformed records, and lines read cut, named one by one; past this, counted
# Bytes tried first when looking for a text, rarest first: in kernel text upper-case letters are rare, and X and V
# the rarest of those the checks' texts hold (byte counts over fixtures/logs/kernel and fixtures/nodes/*/kmsg).
_PROBE_ORDER = b"XVQZJKWYUGBFHOPLDMRCESTNAI"
_RUN_LIMIT = 1024  # hits of a probe byte that are not the text, per chunk, before searching for the texts instead


def read_head(f: BinaryIO, chars: int = HEAD_CHARS) -> tuple[bytes, str]:
    """The file's first bytes, and their text: the first ``chars`` characters of the file's text (or all of it),
    exactly as a decode of the whole file begins. Reads at most 4 * chars + 4 bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    raw: list[bytes] = []
    text: list[str] = []
    have = 0
    while have < chars:
        piece = f.read(min(1 << 16, 4 * (chars - have) + 4))
        if not piece:
            text.append(decoder.decode(b"", final=True))
            break
        raw.append(piece)
        out = decoder.decode(piece)
        text.append(out)
        have += len(out)
    return b"".join(raw), "".join(text)[:chars]


def _probes(needles: Sequence[bytes]) -> list[tuple[bytes, int, tuple[bytes, ...]]]:
    """(probe byte, its offset in each text, the texts) groups: texts that share their rarest byte at one offset
    are checked with one ``startswith`` at each hit of that byte."""
    groups: dict[tuple[bytes, int], list[bytes]] = {}
    for needle in needles:
        _, at = min((_PROBE_ORDER.find(b) if (b := needle[i:i + 1]) in _PROBE_ORDER else 1000 + needle[i], i)
                    for i in range(len(needle)))
        groups.setdefault((needle[at:at + 1], at), []).append(needle)
    return [(probe, at, tuple(texts)) for (probe, at), texts in groups.items()]


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
        from .passive import KernelBatch

        self._batch = KernelBatch
        self.consumers = consumers
        self.states: list[dict[str, Any]] = [{} for _ in consumers]
        self.findings: list[list[Any]] = [[] for _ in consumers]

    def judge(self, records: list[LogRecord]) -> None:
        for i, c in enumerate(self.consumers):
            j = c.judge(self.states[i], self._batch(records, [], None), c.defaults, 0.0, hold=False)
            self.states[i], self.findings[i] = j.state, list(j.findings)


def scan(f: BinaryIO, source: str, kmsg: bool, consumers: Sequence[Any], first: bytes = b"",
         chunk: int = CHUNK, line_max: int = LINE_MAX) -> ScanResult:
    """Reads ``f`` (after ``first``, bytes already read from it) to its end; the findings of ``consumers``
    (KernelConsumers: their ``interest`` texts pick the lines, their judges decide) in their order."""
    judges = _Judges(consumers)
    needles = list(dict.fromkeys(t.encode() for c in consumers for t in c.interest))
    probes = _probes(needles)
    records: list[LogRecord] = []
    errors: list[ParseError] = []
    notes: list[str] = []
    malformed = 0  # malformed kmsg records found
    cut = 0  # lines longer than line_max
    buf = bytearray(chunk + line_max)
    view = memoryview(buf)
    lines = 0  # newlines before buf[0]
    have = 0  # bytes of a partial line at the front of buf
    pending = memoryview(first)
    blank = True
    last: tuple[int, bytes] | None = None  # the last complete line: (line number, bytes)
    read_into = f.readinto
    count, find, rfind = buf.count, buf.find, buf.rfind

    held = 0  # bytes of the lines of the records held for the next batch

    def add(raw: bytes | bytearray, lineno: int) -> None:
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

    def hits(start: int, stop: int) -> list[tuple[int, int]]:
        """(start, end) of the lines in buf[start:stop] (complete lines) that hold a text, in order; end is the
        offset of the line's newline."""
        found: dict[int, int] = {}
        startswith = buf.startswith
        for probe, at, texts in probes:
            i = find(probe, start + at, stop)
            misses = 0
            while i >= 0:
                if startswith(texts, i - at):
                    le = find(b"\n", i, stop)
                    found[rfind(b"\n", start, i) + 1 or start] = le
                    i = find(probe, le + 1 + at, stop)  # on from the next line
                    continue
                misses += 1
                if misses > _RUN_LIMIT:  # the probe byte is common here: search for the texts themselves
                    for text in texts:
                        j = find(text, i - at + 1, stop)
                        while j >= 0:
                            le = find(b"\n", j, stop)
                            found[rfind(b"\n", start, j) + 1 or start] = le
                            j = find(text, le + 1, stop)
                    break
                i = find(probe, i + 1, stop)
        return sorted(found.items()) if len(probes) > 1 else list(found.items())

    def lines_of(start: int, stop: int) -> None:
        """Reads the complete lines buf[start:stop] (stop just past a newline)."""
        nonlocal lines, last, blank
        at = start
        for ls, le in hits(start, stop):
            lines += count(b"\n", at, ls)
            at = ls
            add(buf[ls:le - 1] if le > ls and buf[le - 1] == 13 else buf[ls:le], lines + 1)
        lines += count(b"\n", at, stop)
        ls = rfind(b"\n", start, stop - 1) + 1 or start
        last = (lines, bytes(buf[ls:stop - 1]))
        if blank and buf[start:stop].strip() and not buf[start:stop].decode("utf-8", "replace").isspace():
            blank = False

    def fill(at: int, room: int) -> int:
        nonlocal pending
        if pending:
            n = min(room, len(pending))
            view[at:at + n] = pending[:n]
            pending = pending[n:]
            return n
        return read_into(view[at:at + room])

    while True:
        n = fill(have, chunk)
        end = have + n
        if n == 0:
            break
        nl = rfind(b"\n", 0, end)
        if nl < 0:
            have = end
            if have >= line_max:
                head, size, have = _long_line(buf, line_max, have, fill, chunk)
                lines += 1
                cut += 1
                if cut <= MAX_NOTES:
                    notes.append(f"{source}:{lines}: line of {size} bytes; its first {line_max} bytes read")
                if any(t in head for t in needles):  # read, as any line, only if it holds a text the checks read
                    add(head, lines)
                last = None  # the long line was read as a line of its own
                if blank and head.strip() and not head.decode("utf-8", "replace").isspace():
                    blank = False
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
            add(tail, lines)
    elif kmsg and last is not None and last[1] and not any(t in last[1] for t in needles):
        # The file's last line, if it holds no text (then it was read already): a record cut off by a write that
        # did not finish is found there.
        add(last[1][:-1] if last[1].endswith(b"\r") else last[1], last[0])
    if cut > MAX_NOTES:
        notes.append(f"{source}: {cut - MAX_NOTES} more line(s) longer than {line_max} bytes, read cut")
    if malformed > len(errors):
        notes.append(f"{source}: {malformed - len(errors)} more malformed kmsg record(s), not listed")
    judges.judge(records)
    return ScanResult([f for fs in judges.findings for f in fs], errors, lines, blank, notes)


def _long_line(buf: bytearray, line_max: int, have: int, fill: Callable[[int, int], int],
               chunk: int) -> tuple[bytes, int, int]:
    """A line longer than line_max, whose first ``have`` bytes are at the front of buf: (its first line_max bytes,
    its length, the bytes after its newline, now at the front of buf). The rest of the line is read and skipped."""
    head = bytes(buf[:line_max])
    size = have
    while True:
        n = fill(0, chunk)
        if n == 0:
            return head, size, 0
        nl = buf.find(b"\n", 0, n)
        if nl >= 0:
            buf[0:n - nl - 1] = buf[nl + 1:n]
            return head, size + nl, n - nl - 1
        size += n
