"""The search of agent/node/kernel_scan.py: a saved kernel log's lines read from a buffer refilled in chunks, the ones
that hold a text the kernel-log checks read handed on with their exact line numbers (`_read_lines`), and a part of a
large file read so by a reader process into rows, parsed by one findall of its form's pattern (`_read_part`). The
rules (what is read, what is cut, what is noted) are kernel_scan's docstring."""
from __future__ import annotations

import os
import re
from array import array
from operator import itemgetter
from typing import Any, Callable, Sequence

from gpuwarden.agent.core import log_rows
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.kernel_log import (
    DMESG_LINES,
    FORM_LINES,
    KMSG_ROW,
    PRIO_FACILITY,
    PRIO_LEVEL,
    classify_line,
    kmsg_line,
)
from gpuwarden.agent.core.line_search import ProbeMemory, Probes, lines_holding
from gpuwarden.agent.core.line_search import gather as gather_lines

MAX_NOTES = 1000  # malformed records, and lines read cut, named one by one; past this, counted

# A part's records: a row a record, (message, line, seq, usec, priority, timestamp, facility), or for a part in dmesg
# form read in C the columns (messages, line numbers, stamps, ends): the numbers and the ends as bytes of native
# int64s (array "q"), every record's stamp "secs.frac" one after the other in the bytes stamps, record k's ending at
# ends[k]; seq, priority, timestamp and facility are None. marshal sends the columns as a few objects where the rows
# are a tuple, an int and a str a record. kernel_scan.RowRecords takes either.
Rows = list[tuple[Any, ...]] | tuple[list[str], bytes, bytes, bytes]


# A byte that is text and no white space whatever the bytes around it (ASCII, and not one str.isspace takes): where
# one is found the lines are not blank, without a copy of them (a copy of a chunk is fresh pages each time).
_SURELY_TEXT = re.compile(rb"[^\t\n\x0b\x0c\r\x1c-\x1f \x80-\xff]").search


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
        if gather is not None:
            joined, numbers, newlines = gather_lines(buf, start, stop, probes, lines, memory)
            if numbers:
                gather(joined, numbers)
            lines += newlines
        else:
            at = start
            for ls, le in lines_holding(buf, start, stop, probes, memory):
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


def _read_part(fd: int, start: int, stop: int, final: bool, kmsg: bool, needles: Sequence[bytes],
               probes: Probes, buf: bytearray, chunk: int,
               line_max: int, memory: ProbeMemory | None = None) -> tuple[Any, ...]:
    """One part's result: (rows of the records, malformed kmsg records (what, line), their count, lines read cut
    (line, length), their count, lines, blank); line numbers from 1 at the part's first line (the file's name and
    the lines before the part are put to them where the parts are taken)."""
    rows: Rows = []
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
            rows = _kmsg_rows(raws, linenos, errs, counts)
        else:
            rows = _text_rows(raws, linenos)
    return rows, errs, counts[0], cuts, counts[1], lines, blank


def _text_rows(raws: list[bytes | bytearray], linenos: list[int]) -> Rows:
    """The rows of a text file's lines, as parse_line's text branch reads them: the lines in the part's form (its
    first line's: dmesg, dmesg -T, ISO, syslog/journal) read by one findall of kernel_log's pattern of that form
    over them all, any other line through classify_line: one pattern over the part's lines instead of several
    matches and a function call for each line. A dmesg part is read in C where it is built (_dmesg_rows_native)."""
    joined = b"\n".join(raws)
    # One object for each text that repeats (a flood's lines do): marshal sends it once and refers to it after, and
    # the judges here find the hash of a text they look up already made. A stamp goes as its text ("secs.frac"):
    # RowRecords makes it a number for the records a judge asks for, most of a flood's never are.
    same: dict[str, str] = {}
    first = joined.find(b"\n")
    # The first line decoded alone reads as it does in the whole (a newline ends any bad UTF-8 before it).
    form = classify_line((joined if first < 0 else joined[:first]).decode("utf-8", "replace"))[0]
    lines = FORM_LINES.get({"journal": "dmesg-ctime", "journal-iso": "dmesg-iso"}.get(form, form))
    if lines is None and log_rows.native is not None:
        return _dmesg_rows_native(joined, linenos, same)
    text = joined.decode("utf-8", "replace")
    if lines is None:
        return _dmesg_pattern_rows(text, linenos, same)
    rows: list[tuple[Any, ...]] = []
    # A line holds no newline, so each is one match (zip's strict= would say otherwise, and the part fail whole).
    for (timestamp, secs, frac, message), lineno in zip(lines.findall(text), linenos, strict=True):
        if timestamp:
            rows.append((same.setdefault(message, message), lineno, None, f"{secs}.{frac}" if secs else None, None,
                         timestamp, None))
        elif message and not message.isspace():
            _, message, timestamp, usec, priority, seq = classify_line(message)
            rows.append((message, lineno, seq, usec, priority, timestamp, None))
    return rows


def _dmesg_rows_native(joined: bytes, linenos: list[int], same: dict[str, str]) -> Rows:
    """_text_rows' dmesg branch in C (agent/core/_log_rows.c), as columns (see Rows) where every line is a record
    with a stamp. The lines the C code is not sure of come back deferred and are read here by the pattern, so the
    rows are the pattern's; where there are such lines the part goes as rows."""
    messages, stamps, ends, deferred = log_rows.native.dmesg_rows(joined, linenos, same)
    if not deferred:
        return (messages, array("q", linenos).tobytes(), stamps, ends)
    sure = [(message, lineno, None, stamp, None, None, None)
            for message, lineno, stamp in zip(messages, linenos, stamp_texts(stamps, ends), strict=True)
            if message is not None]
    text = b"\n".join(raw for _, raw in deferred).decode("utf-8", "replace")
    read = _dmesg_pattern_rows(text, [linenos[k] for k, _ in deferred], same)
    return sorted(sure + read, key=itemgetter(1))  # each line's number is its own: the lines in the file's order


def _dmesg_pattern_rows(text: str, linenos: list[int], same: dict[str, str]) -> list[tuple[Any, ...]]:
    """The rows of newline-joined dmesg lines by DMESG_LINES (a line of white space only is no record)."""
    rows: list[tuple[Any, ...]] = []
    # A line holds no newline, so each is one match (zip's strict= would say otherwise, and the part fail whole).
    for (secs, frac, message), lineno in zip(DMESG_LINES.findall(text), linenos, strict=True):
        if secs:
            rows.append((same.setdefault(message, message), lineno, None, f"{secs}.{frac}", None, None, None))
        elif message and not message.isspace():
            _, message, timestamp, usec, priority, seq = classify_line(message)
            rows.append((message, lineno, seq, usec, priority, timestamp, None))
    return rows


def stamp_texts(stamps: bytes, ends: bytes) -> list[str]:
    """Each record's stamp text of dmesg columns (see Rows)."""
    cut = memoryview(ends).cast("q")
    return [stamps[cut[k - 1] if k else 0:cut[k]].decode("ascii") for k in range(len(cut))]


def _kmsg_rows(raws: list[bytes | bytearray], linenos: list[int], errs: list[tuple[str, int]],
               counts: list[int]) -> list[tuple[Any, ...]]:
    """The rows of a raw kmsg file's lines, as parse_line's kmsg branch reads them: the well-formed records by one
    findall of KMSG_ROW over them all, any other line (a malformed record, one past the pattern's bounds) through
    kmsg_line, the exact test."""
    read = KMSG_ROW.findall(b"\n".join(raws).decode("utf-8", "replace"))
    rows: list[tuple[Any, ...]] = []
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
    return rows
