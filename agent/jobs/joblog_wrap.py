"""Whether a job log's lines were hard-wrapped by a terminal, and at what width (a pasted watchdog message), for the
reader (agent/jobs/joblog.py), which then reads each wrapped line whole."""
from __future__ import annotations

import re

_RECORD_START = re.compile(rb"^(?:\[|\s*\d+: |\S+:\d+:\d+ \[|Traceback|  File |\s*$)")


def starts_record(line: bytes) -> bool:
    """A line that opens a record of its own (a launcher's or NCCL's prefix, a traceback), never a wrapped line's
    continuation."""
    return _RECORD_START.match(line) is not None


def wrap_width(head: bytes) -> int | None:
    """The width a terminal hard-wrapped the file's lines at (116 in a pasted watchdog message): the length most long
    lines have, where lines of that length go on in a line that opens no record of its own. Identical messages
    (every rank's same watchdog line) have one length too, but each opens its own record."""
    lines = [line.rstrip(b"\r") for line in head.split(b"\n")[:-1][:2000]]
    lengths: dict[int, int] = {}
    long = 0
    for line in lines:
        if len(line) >= 60:
            long += 1
            lengths[len(line)] = lengths.get(len(line), 0) + 1
    if not lengths:
        return None
    width, count = max(lengths.items(), key=lambda kv: kv[1])
    if count < 3 or count * 2 < long:
        return None
    # A wrap cuts words: a line of that width that ends inside a word whose rest opens the next line. Lines that
    # merely share a length (a progress line's fixed format) end where a field ends.
    split_words = sum(1 for a, b in zip(lines, lines[1:], strict=False)
                      if len(a) == width and b and not starts_record(b) and _word(a[-1:]) and _word(b[:1]))
    return width if split_words >= 2 else None


def _word(ch: bytes) -> bool:
    return ch.isalnum() or ch == b"_"
