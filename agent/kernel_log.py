"""Kernel log text -> LogRecords: raw /dev/kmsg records, and dmesg / journalctl / syslog text with the
prefix stripped so ``message`` is what the kernel printed. Pure functions of the text passed in.

Only a kmsg record whose header is broken is an error; any other line that matches no known shape is kept
with the whole line as its message (it may still be a plain kernel message).
"""
from __future__ import annotations

import gc
import re
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, fields, make_dataclass
from typing import Iterator

from .errors import ParseError


@dataclass(frozen=True, slots=True)
class LogRecord:
    message: str
    line: int  # 1-based line of the record's first line in the source
    source: str
    seq: int | None = None  # kmsg sequence number (the follower's cursor)
    usec: int | None = None  # microseconds since boot (kmsg header, or a dmesg "[secs.frac]" stamp)
    priority: int | None = None  # syslog level 0 (emerg) .. 7 (debug)
    timestamp: str | None = None  # the text timestamp as written (dmesg -T / iso, journal, syslog)
    facility: int | None = None  # syslog facility (0 = kern), kmsg only


# Speed (the daemon pushes >= 1M lines/s through the kmsg parser): a frozen dataclass's __init__ sets
# each field through object.__setattr__ and costs ~4x a plain one. Records are built as this mutable
# twin with the identical slot layout, then retyped to LogRecord (CPython allows __class__ assignment
# between layout-compatible classes); what callers get is an ordinary frozen LogRecord.
_LogRecordBuilder = make_dataclass(
    "_LogRecordBuilder", [(f.name, f.type) for f in fields(LogRecord)], slots=True
)


@contextmanager
def _gc_paused() -> Iterator[None]:
    # Records hold only str/int, so they form no cycles; left on, the collector re-walks the growing
    # list of young records again and again and halves the parse rate of a large log.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---------------------------------------------------------------- raw /dev/kmsg
def parse_kmsg_text(text: str, source: str) -> tuple[list[LogRecord], list[ParseError]]:
    """Parse ``<prio>,<seq>,<usec>,<flags>[,more];message`` records, one a line.

    Lines starting with a space are the record's " KEY=value" dictionary (continuation), not records.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    records: list[LogRecord] = []
    errors: list[ParseError] = []
    append, build, record_type = records.append, _LogRecordBuilder, LogRecord
    with _gc_paused():
        # partition/split and str predicates rather than a regex per line: this is the hot loop.
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line or line[0] == " ":
                continue  # blank, or a continuation line of the record before
            head, sep, message = line.partition(";")
            header = head.split(",", 3)  # prio, seq, usec, flags[,more]
            if sep and len(header) == 4 and head.isascii() and len(head) < 96:
                prio, seq, usec, _ = header
                # isdigit on ASCII text is [0-9]+: rejects "", "-1", " 5", "1_0" that int() would take;
                # the length bound keeps int() off absurd digit strings (it refuses > 4300 digits).
                if prio.isdigit() and seq.isdigit() and usec.isdigit():
                    p = int(prio)
                    r = build(message, lineno, source, int(seq), int(usec), p & 7, None, p >> 3)
                    r.__class__ = record_type
                    append(r)
                    continue
            errors.append(ParseError(_kmsg_complaint(line, sep, header), source, lineno))
    return records, errors


def _kmsg_complaint(line: str, sep: str, header: list[str]) -> str:
    shown = line if len(line) <= 80 else line[:77] + "..."
    if not sep:
        why = "no ';' between header and message"
    elif len(header) < 4:
        why = "header needs <prio>,<seq>,<usec>,<flags>"
    else:
        why = "prio, seq and usec must be short unsigned decimal integers"
    return f"malformed kmsg record ({why}): {shown!r}"


# ---------------------------------------------------------------- dmesg / journal / syslog text
_KMSG = re.compile(r"(\d{1,10}),(\d{1,19}),(\d{1,19}),[^;]*;")
# dmesg -x / --decode: "kern  :warn  : "
_DECODE = re.compile(r"([a-z]{2,8}) *:([a-z]{3,6}) *: ")
_LEVELS = {"emerg": 0, "alert": 1, "crit": 2, "err": 3, "warn": 4, "notice": 5, "info": 6, "debug": 7}
_MONO = re.compile(r"\[ *(\d{1,12})\.(\d{1,9})\] ?")  # dmesg: "[ 1234.567890] "
_CTIME = re.compile(r"\[([A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\] ?")  # dmesg -T
# dmesg --time-format iso (comma fraction) and journalctl -o short-iso[-precise] / RFC 3339 syslog
_ISO = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?) ")
_SYSLOG = re.compile(r"([A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d) (\S+) ")  # "Jan 01 09:30:56 host "
_HOST_KERNEL = re.compile(r"\S+ kernel: ")  # journal/syslog "host kernel: " after the timestamp
# A kernel line quoted inside other text ("mynode-066 | ERROR: ... [ 3606.832215] NVRM: Xid ..."):
# only NVIDIA driver lines are looked for, so ordinary text is not cut at a stray "[1.5]".
_EMBEDDED = re.compile(r"(?:\[ *(\d{1,12})\.(\d{1,9})\] )?(?=NVRM: |nvidia-nvswitch\d+: )")


def _usec(secs: str, frac: str) -> int:
    return int(secs) * 1_000_000 + int((frac + "000000")[:6])


def _classify(line: str) -> tuple[str, str, str | None, int | None, int | None, int | None]:
    """One line -> (format, message, timestamp, usec, priority, seq)."""
    s = line.lstrip()
    m = _KMSG.match(s)
    if m:
        p = int(m[1])
        return "kmsg", s[m.end():], None, int(m[3]), p & 7, int(m[2])
    priority = None
    fmt = ""
    m = _DECODE.match(s)
    if m and m[2] in _LEVELS:
        priority, s, fmt = _LEVELS[m[2]], s[m.end():], "dmesg-decode"
    timestamp = usec = None
    kind = ""
    if s.startswith("["):
        m = _MONO.match(s)
        if m:
            usec, kind, s = _usec(m[1], m[2]), "dmesg", s[m.end():]
        else:
            m = _CTIME.match(s)
            if m:
                timestamp, kind, s = m[1], "dmesg-ctime", s[m.end():]
    elif s[:1].isdigit():
        m = _ISO.match(s)
        if m:
            timestamp, kind, s = m[1], "dmesg-iso", s[m.end():]
    elif s[:1].isupper():
        m = _SYSLOG.match(s)
        if m:
            timestamp, kind, s = m[1], "syslog", s[m.end():]
            if s.startswith("kernel: "):
                s = s[8:]
    if kind and kind != "syslog":
        # journalctl (short-iso, short-monotonic) puts "host kernel: " after its timestamp.
        m = _HOST_KERNEL.match(s)
        if m:
            s = s[m.end():]
            kind = "journal-iso" if kind == "dmesg-iso" else "journal"
    if kind in ("syslog", "journal-iso", "journal") and s.startswith("["):
        m = _MONO.match(s)  # kern.log keeps the kernel's own "[secs.frac]" after "kernel: "
        if m:
            usec, s = _usec(m[1], m[2]), s[m.end():]
    if kind:
        if fmt and kind.startswith("dmesg"):
            kind = fmt + kind[5:]
        return kind, s, timestamp, usec, priority, None
    if fmt:  # dmesg --decode --notime
        return fmt, s, None, None, priority, None
    m = _EMBEDDED.search(s)
    if m and m.end() > 0:
        return "embedded", s[m.end():], None, _usec(m[1], m[2]) if m[1] else None, None, None
    return "plain", line, None, None, None, None


def detect_format(text: str) -> str:
    """The dominant line format of ``text``: kmsg, dmesg, dmesg-ctime, dmesg-iso, dmesg-decode[-iso|-ctime],
    journal, journal-iso, syslog, embedded, plain (nothing recognised) or empty."""
    votes: Counter[str] = Counter()
    for line in text.split("\n", 2000)[:2000]:
        if line.strip():
            fmt = _classify(line)[0]
            if not (fmt == "plain" and line[0] == " "):  # kmsg continuation lines do not vote
                votes[fmt] += 1
    if not votes:
        return "empty"
    # Raw kmsg turns every other line into an error, so it must hold the majority, not just lead: a
    # document quoting one kmsg record among prose is text.
    if votes["kmsg"] * 2 > sum(votes.values()):
        return "kmsg"
    known = [(n, f) for f, n in votes.items() if f not in ("plain", "kmsg")]
    return max(known)[1] if known else "plain"


def parse_log_text(text: str, source: str) -> tuple[list[LogRecord], list[ParseError]]:
    """Parse kernel log text of any supported format, detected per line (raw kmsg as a whole)."""
    if detect_format(text) == "kmsg":
        return parse_kmsg_text(text, source)
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    records: list[LogRecord] = []
    with _gc_paused():
        for lineno, line in enumerate(text.split("\n"), 1):
            if line and not line.isspace():
                _, message, timestamp, usec, priority, seq = _classify(line)
                records.append(LogRecord(message, lineno, source, seq, usec, priority, timestamp))
    return records, []
