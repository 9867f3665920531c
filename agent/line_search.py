"""The lines of a byte buffer that hold one of a few fixed texts, found at C speed: what the kernel-log readers (a
saved file, agent/kernel_scan.py; the followed kernel log, agent/sources/kmsg.py) decode and parse, while every other
line is skipped unread.

Each text is looked for by its rarest byte (``bytes.find`` of one byte is memchr), and the text checked where that
byte is; texts that share their rarest byte at one offset are checked together. Where the byte turns out common
(more hits that are not a text than one per RUN_BYTES of the buffer, and at least RUN_MIN), the texts themselves are
searched for instead: past that density a C search for the text costs less than a step of Python per hit.
"""
from __future__ import annotations

from typing import Sequence

# Bytes tried first when looking for a text, rarest first: in kernel text upper-case letters are rare, and X and V
# the rarest of those the checks' texts hold (byte counts over fixtures/logs/kernel and fixtures/nodes/*/kmsg).
PROBE_ORDER = b"XVQZJKWYUGBFHOPLDMRCESTNAI"
RUN_BYTES = 1024  # a probe byte that hits no text more often than once per this many bytes of a buffer ...
RUN_MIN = 16  # ... (and more than this many times) is left for a search of the texts themselves

Probes = Sequence[tuple[bytes, int, tuple[bytes, ...]]]


def probes_for(needles: Sequence[bytes]) -> list[tuple[bytes, int, tuple[bytes, ...]]]:
    """(probe byte, its offset in each text, the texts) groups: texts that share their rarest byte at one offset
    are checked with one ``startswith`` at each hit of that byte."""
    groups: dict[tuple[bytes, int], list[bytes]] = {}
    for needle in needles:
        _, at = min((PROBE_ORDER.find(b) if (b := needle[i:i + 1]) in PROBE_ORDER else 1000 + needle[i], i)
                    for i in range(len(needle)))
        groups.setdefault((needle[at:at + 1], at), []).append(needle)
    return [(probe, at, tuple(texts)) for (probe, at), texts in groups.items()]


def lines_holding(buf: bytes | bytearray, start: int, stop: int, probes: Probes) -> list[tuple[int, int]]:
    """(start, end) of each line of buf[start:stop] (complete lines: stop just past a newline) that holds one of the
    probes' texts, in order; end is the offset of the line's newline."""
    found: dict[int, int] = {}
    find, rfind, startswith = buf.find, buf.rfind, buf.startswith
    limit = max(RUN_MIN, (stop - start) // RUN_BYTES)
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
            if misses > limit:  # the probe byte is common here: search for the texts themselves
                for text in texts:
                    j = find(text, i - at + 1, stop)
                    while j >= 0:
                        le = find(b"\n", j, stop)
                        found[rfind(b"\n", start, j) + 1 or start] = le
                        j = find(text, le + 1, stop)
                break
            i = find(probe, i + 1, stop)
    return sorted(found.items()) if len(probes) > 1 else list(found.items())
