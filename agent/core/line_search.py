"""The lines of a byte buffer that hold one of a few fixed texts, found at C speed: what the kernel-log readers (a
saved file, agent/node/kernel_scan.py; the followed kernel log, agent/sources/kmsg_scan.py) and the job-log reader
(agent/jobs/joblog.py) decode and parse, while every other line is skipped unread.

Where the package was built with its C part (agent/core/_line_scan.c: a C compiler and Python's headers at build
time; the Debian package and CI have both), lines_holding and gather are that module's: one pass of C finds the
lines, counts the newlines between them and joins them, with no step of Python per line (on a log with 10 % XID
lines that step was most of analyze's time); with more than four probes (the job-log reader's twenty) one vector pass
looks for all the texts at once (agent/core/_multi_find.h: 157 MB in 21 ms, where twenty passes took 350). Otherwise
the search below runs, with the same answers (tests/test_line_scan_native.py compares both).

Each text is looked for by its rarest byte (``bytes.find`` of one byte is memchr), and the text checked where that
byte is; texts that share their rarest byte at one offset are checked together. Where the byte turns out common
(more hits that are not a text than one per RUN_BYTES of the buffer, and at least RUN_MIN), the texts themselves are
searched for instead: past that density a C search for the text costs less than a step of Python per hit. A stream
read in buffers (a followed log, a file's parts) keeps what each buffer taught in a ProbeMemory: a probe byte common
in one buffer is common in the next, and its texts are searched for at once there rather than after RUN_MIN..
(size / RUN_BYTES) steps of Python again (1M lines of a log whose noise holds the probe bytes: some 800 steps a
256 KiB buffer, a tenth of the follower's time).
"""
from __future__ import annotations

from typing import Sequence

try:  # the same search in C (agent/core/_line_scan.c), where the package was built with it
    from gpuwarden.agent.core import _line_scan as native
except ImportError:  # built without a C compiler: the search below, with the same answers
    native = None

# Bytes tried first when looking for a text, rarest first: in kernel text upper-case letters are rare, and X and V
# the rarest of those the checks' texts hold (byte counts over fixtures/logs/kernel and fixtures/nodes/*/kmsg).
PROBE_ORDER = b"XVQZJKWYUGBFHOPLDMRCESTNAI"
RUN_BYTES = 1024  # a probe byte that hits no text more often than once per this many bytes of a buffer ...
RUN_MIN = 16  # ... (and more than this many times) is left for a search of the texts themselves

FORGET_AFTER = 64  # buffers after which a ProbeMemory forgets: a probe byte that turned rare again is used again

Probes = Sequence[tuple[bytes, int, tuple[bytes, ...]]]


class ProbeMemory:
    """Which probes turned out common in the earlier buffers of one stream (their positions in the probes), for
    lines_holding to search for their texts at once. One per stream and thread; what it holds changes only the
    route, never the lines found."""

    __slots__ = ("common", "buffers")

    def __init__(self) -> None:
        self.common: set[int] = set()
        self.buffers = 0

    def next_buffer(self) -> set[int]:
        self.buffers += 1
        if self.buffers % FORGET_AFTER == 0:
            self.common.clear()
        return self.common


def probes_for(needles: Sequence[bytes]) -> list[tuple[bytes, int, tuple[bytes, ...]]]:
    """(probe byte, its offset in each text, the texts) groups: texts that share their rarest byte at one offset
    are checked with one ``startswith`` at each hit of that byte."""
    groups: dict[tuple[bytes, int], list[bytes]] = {}
    # A text that holds another is found with it ("SXid" with "Xid"): one search less, and no line of the one is a
    # miss of the other's probe byte.
    needles = [n for n in needles if not any(o != n and o in n for o in needles)]
    for needle in needles:
        _, at = min((PROBE_ORDER.find(b) if (b := needle[i:i + 1]) in PROBE_ORDER else 1000 + needle[i], i)
                    for i in range(len(needle)))
        groups.setdefault((needle[at:at + 1], at), []).append(needle)
    return [(probe, at, tuple(texts)) for (probe, at), texts in groups.items()]


def lines_holding(buf: bytes | bytearray, start: int, stop: int, probes: Probes,
                  memory: ProbeMemory | None = None) -> list[tuple[int, int]]:
    """(start, end) of each line of buf[start:stop] (complete lines: stop just past a newline) that holds one of the
    probes' texts, in order; end is the offset of the line's newline. `memory`: what earlier buffers of the same
    stream taught (updated here; the C search needs none)."""
    if native is not None:
        return native.lines_holding(buf, start, stop, probes)
    return python_lines_holding(buf, start, stop, probes, memory)


def gather(buf: bytes | bytearray, start: int, stop: int, probes: Probes, base: int,
           memory: ProbeMemory | None = None) -> tuple[bytes, list[int], int]:
    """The lines of buf[start:stop] (complete lines) that hold one of the probes' texts, joined by newlines with the
    CR of a CRLF end taken off each; the number of each (``base`` + the newlines before it + 1); the newlines of
    the region. One call where a reader hands many lines on together. `memory`: as for lines_holding."""
    if native is not None:
        return native.gather(buf, start, stop, probes, base)
    return python_gather(buf, start, stop, probes, base, memory)


def new_repeats(max_lines: int, max_line: int) -> object | None:
    """A table of lines known by their shape that gather_counting counts instead of handing them on
    (agent/core/_repeats.h), where the package was built with its C part; None otherwise: every found line is handed
    on, and the reader's answers are the same."""
    return native.Repeats(max_lines, max_line) if native is not None else None


def gather_counting(buf: bytes | bytearray, start: int, stop: int, probes: Probes, base: int, repeats: object | None,
                    memory: ProbeMemory | None = None) -> tuple[bytes, list[int], int, Sequence[int], int]:
    """gather, with the found lines that `repeats` (new_repeats) knows counted there and not handed on: (joined,
    numbers, newlines, befores, found), befores the found lines before each line handed on, found all of them."""
    if repeats is not None:
        return native.gather(buf, start, stop, probes, base, 1, repeats)
    joined, numbers, newlines = gather(buf, start, stop, probes, base, memory)
    return joined, numbers, newlines, range(len(numbers)), len(numbers)


def python_gather(buf: bytes | bytearray, start: int, stop: int, probes: Probes, base: int,
                  memory: ProbeMemory | None = None) -> tuple[bytes, list[int], int]:
    """gather in Python: the C search's fallback, and its reference in the tests."""
    numbers = []
    at, lines = start, base
    spans = python_lines_holding(buf, start, stop, probes, memory)
    for ls, _ in spans:
        lines += buf.count(b"\n", at, ls)
        at = ls
        numbers.append(lines + 1)
    joined = b"\n".join([buf[ls:le] for ls, le in spans])
    if b"\r" in joined:
        joined = joined.replace(b"\r\n", b"\n").removesuffix(b"\r")
    return joined, numbers, lines - base + buf.count(b"\n", at, stop)


def python_lines_holding(buf: bytes | bytearray, start: int, stop: int, probes: Probes,
                         memory: ProbeMemory | None = None) -> list[tuple[int, int]]:
    """lines_holding in Python: the C search's fallback, and its reference in the tests."""
    found: dict[int, int] = {}
    find, rfind, startswith = buf.find, buf.rfind, buf.startswith
    limit = max(RUN_MIN, (stop - start) // RUN_BYTES)
    common = memory.next_buffer() if memory is not None else set()
    for n, (probe, at, texts) in enumerate(probes):
        text_from = start if n in common else None  # where the texts themselves are searched for, if they are
        i = find(probe, start + at, stop) if text_from is None else -1
        misses = 0
        while i >= 0:
            if startswith(texts, i - at, stop):
                le = find(b"\n", i, stop)
                found[rfind(b"\n", start, i) + 1 or start] = le
                if le < 0:  # a region that ends mid-line: that line was its last
                    break
                i = find(probe, le + 1 + at, stop)  # on from the next line
                continue
            misses += 1
            if misses > limit:  # the probe byte is common here: search for the texts themselves
                text_from = i - at + 1
                if memory is not None:
                    common.add(n)
                break
            i = find(probe, i + 1, stop)
        if text_from is not None:
            for text in texts:
                j = find(text, text_from, stop)
                while j >= 0:
                    le = find(b"\n", j, stop)
                    found[rfind(b"\n", start, j) + 1 or start] = le
                    j = find(text, le + 1, stop) if le >= 0 else -1
    return sorted(found.items()) if len(probes) > 1 else list(found.items())
