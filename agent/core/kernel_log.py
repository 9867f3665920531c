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
from dataclasses import fields, make_dataclass
from typing import Callable, Iterator, NamedTuple

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass


@dataclass(frozen=True, slots=True)
class LogRecord:
    message: str
    # 1-based line of the record's first line in its file; None where the record is no file's line (live /dev/kmsg:
    # its seq names it)
    line: int | None
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
LogRecordBuilder = make_dataclass(
    "LogRecordBuilder", [(f.name, f.type) for f in fields(LogRecord)], slots=True
)


@contextmanager
def gc_paused() -> Iterator[None]:
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
# Speed (bench/kmsg_parse.py: 1 M records on a 2-core VM; figures in bench/README.md).
# The parser was a per-line loop (split the text, partition at ';', split the header, isdigit and int()
# per field, the builder's __init__): ~1.25 s per 1 M lines. Now ~0.87 s; kept, from what was measured:
# * One regex over the text (findall, a chunk at a time) yields a row per line: header validation and the
#   cut into prio/seq/usec/message happen in C, ~0.24 s per 1 M lines, against ~0.5 s for split + partition
#   + split + isdigit in Python. Chunks of ~64k characters keep the rows list small (no 1 M-tuple list);
#   one findall over the whole text measured ~10% slower than chunks of 4k-256k.
# * The record's slots are stored inline (object.__new__ + 8 slot stores, then retyped) rather than through
#   the builder's generated __init__: ~50 ns a record less.
# * prio -> (level, facility) by dict lookup for the usual prio strings, not int() and arithmetic.
# Tried and not kept: split(",", 3) before finding ';' (no faster than partition first), enumerate vs a
# counter (no difference), a header lookahead in the regex (15% of the regex time; bounds instead).
# Of the ~0.6 s left after the regex, ~0.14 s is the two int() calls seq and usec need, and most of the
# rest is allocating the records (~250 bytes each with their message and ints); hence parse_kmsg_filtered,
# which builds only the records a caller keeps (~0.45 s per 1 M lines).
#
# One match per line, in order (the text's lines are exactly the rows, so a row's index is its line):
# a record whose header is of the usual size gives (prio, seq, usec, message); any other line gives
# ("", "", "", line), because the header group is optional and (.*) then takes the whole line. A match
# is always a well-formed record by the old per-line test: prio, seq and usec are [0-9]+ (what isdigit
# accepts on ASCII text, so not "", "-1", " 5", "1_0" that int() would take), the flags run to the first
# ';' in ASCII, and the bounds (10 + 20 + 20 + 30 + 3 separators = 83) keep the header under 96
# characters (int() refuses > 4300 digits) without a lookahead: that lookahead cost ~15% of the regex
# time. A well-formed header past these bounds (a 21-digit seq, long flags) goes to kmsg_line, which is
# the exact test. Possessive quantifiers: nothing needs backtracking, and a long bad line stays linear.
KMSG_ROW = re.compile(r"^(?:([0-9]{1,10}+),([0-9]{1,20}+),([0-9]{1,20}+),[\x00-\t\x0b-:<-\x7f]{0,30}+;)?+(.*+)", re.M)
_U64 = 1 << 64
_CHUNK = 1 << 16  # characters of text per findall, cut at a line end
PRIO_LEVEL = {str(p): p & 7 for p in range(192)}  # prio = facility * 8 + level; facilities 0..23
PRIO_FACILITY = {str(p): p >> 3 for p in range(192)}


def _kmsg_rows(text: str) -> Iterator[list[tuple[str, str, str, str]]]:
    """The rows of KMSG_ROW for every line of ``text`` (blank ones included), a chunk at a time."""
    findall = KMSG_ROW.findall
    n, pos = len(text), 0
    while pos <= n:
        end = text.find("\n", pos + _CHUNK)
        if end < 0:
            end = n
        # findall(text, pos, end) sees text[pos:end] as the whole string, without copying it; pos is 0 or
        # just after a newline, so '^' holds there, and each line of the chunk gives exactly one row.
        yield findall(text, pos, end)
        pos = end + 1


def kmsg_record(message: str, lineno: int, source: str, prio: str, seq: str, usec: str) -> LogRecord:
    try:
        level, facility = PRIO_LEVEL[prio], PRIO_FACILITY[prio]
    except KeyError:  # "0006", or a prio past the 24 facilities: still a number
        p = int(prio)
        level, facility = p & 7, p >> 3
    r = LogRecordBuilder(message, lineno, source, int(seq), int(usec), level, None, facility)
    r.__class__ = LogRecord
    return r


def kmsg_line(line: str, source: str, lineno: int) -> LogRecord | ParseError:
    """The exact per-line test, for a line KMSG_ROW did not take as a record: a ParseError, or the record
    for a well-formed header beyond the regex's bounds."""
    head, sep, message = line.partition(";")
    header = head.split(",", 3)  # prio, seq, usec, flags[,more]
    if sep and len(header) == 4 and head.isascii() and len(head) < 96:
        prio, seq, usec, _ = header
        # isdigit on ASCII text is [0-9]+: rejects "", "-1", " 5", "1_0" that int() would take;
        # the length bound keeps int() off absurd digit strings (it refuses > 4300 digits), and each
        # number fits the kernel's u64 (seq and the timestamp are u64; prio far less).
        if (prio.isdigit() and seq.isdigit() and usec.isdigit() and max(len(prio), len(seq), len(usec)) <= 20
                and max(int(prio), int(seq), int(usec)) < _U64):
            return kmsg_record(message, lineno, source, prio, seq, usec)
    return ParseError(_kmsg_complaint(line, sep, header), source, lineno)


def parse_kmsg_text(text: str, source: str) -> tuple[list[LogRecord], list[ParseError]]:
    """Parse ``<prio>,<seq>,<usec>,<flags>[,more];message`` records, one a line.

    Lines starting with a space are the record's " KEY=value" dictionary (continuation), not records.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    records: list[LogRecord] = []
    errors: list[ParseError] = []
    append = records.append
    new, builder, record_type, level_of, facility_of, int_ = (
        object.__new__, LogRecordBuilder, LogRecord, PRIO_LEVEL, PRIO_FACILITY, int)
    lineno = 0
    with gc_paused():
        for rows in _kmsg_rows(text):
            for prio, seq, usec, message in rows:  # the hot loop
                lineno += 1
                if prio:
                    r = new(builder)
                    r.message = message
                    r.line = lineno
                    r.source = source
                    r.seq = int_(seq)
                    r.usec = int_(usec)
                    try:
                        r.priority = level_of[prio]
                        r.facility = facility_of[prio]
                    except KeyError:  # "0006", or a prio past the 24 facilities: still a number
                        p = int_(prio)
                        r.priority, r.facility = p & 7, p >> 3
                    r.timestamp = None
                    r.__class__ = record_type
                    append(r)
                elif message and message[0] != " ":  # not blank, not a continuation line: the whole line
                    one = kmsg_line(message, source, lineno)
                    (errors if type(one) is ParseError else records).append(one)
    return records, errors


class KmsgBatch(NamedTuple):
    """What parse_kmsg_filtered found in one piece of /dev/kmsg text."""

    records: list[LogRecord]  # the well-formed records whose message ``keep`` accepted, in order
    errors: list[ParseError]  # every malformed record, kept or not (exactly parse_kmsg_text's errors)
    last_seq: int | None  # seq of the last well-formed record of the text, kept or not; None if none


def parse_kmsg_filtered(text: str, source: str, keep: Callable[[str], object]) -> KmsgBatch:
    """parse_kmsg_text, building records only for messages ``keep`` accepts (truthy).

    Every line is still validated: malformed records come back in ``errors`` with their lines, and
    ``last_seq`` is the seq of the last well-formed record (kept or not), so a follower can advance its
    cursor past records it did not keep. Records that are returned are identical to parse_kmsg_text's
    (same line numbers and fields). ``keep`` is called once per well-formed record with its message, so it
    should be cheap, e.g. ``lambda m: "NVRM: " in m or "SXid" in m``: per 1 M messages one ``in`` test costs
    ~0.04 s, six ~0.19 s, a compiled six-way alternation's ``.search`` ~0.3 s. It must accept every message
    any consumer of the records looks at (the xid check: "NVRM: "); what it rejects is never seen.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    records: list[LogRecord] = []
    errors: list[ParseError] = []
    last = ""
    lineno = 0
    with gc_paused():
        for rows in _kmsg_rows(text):
            for prio, seq, usec, message in rows:
                lineno += 1
                if prio:
                    last = seq
                    if keep(message):
                        records.append(kmsg_record(message, lineno, source, prio, seq, usec))
                elif message and message[0] != " ":
                    one = kmsg_line(message, source, lineno)
                    if type(one) is ParseError:
                        errors.append(one)
                    else:
                        last = str(one.seq)
                        if keep(one.message):
                            records.append(one)
    return KmsgBatch(records, errors, int(last) if last else None)


def _kmsg_complaint(line: str, sep: str, header: list[str]) -> str:
    shown = line if len(line) <= 80 else line[:77] + "..."
    if not sep:
        why = "no ';' between header and message"
    elif len(header) < 4:
        why = "header needs <prio>,<seq>,<usec>,<flags>"
    else:
        why = "prio, seq and usec must be unsigned decimal integers under 2**64"
    return f"malformed kmsg record ({why}): {shown!r}"


# ---------------------------------------------------------------- dmesg / journal / syslog text
_KMSG = re.compile(r"(\d{1,10}),(\d{1,19}),(\d{1,19}),[^;]*+;")
# dmesg -x / --decode: "kern  :warn  : "
_DECODE = re.compile(r"([a-z]{2,8}) *:([a-z]{3,6}) *: ")
_LEVELS = {"emerg": 0, "alert": 1, "crit": 2, "err": 3, "warn": 4, "notice": 5, "info": 6, "debug": 7}
_STAMP = r"\[ *+(\d{1,12})\.(\d{1,9})\]"
_DMESG_STAMP_RE = re.compile(_STAMP + " ?")  # dmesg: "[ 1234.567890] "
_CTIME = re.compile(r"\[([A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\] ?")  # dmesg -T
# dmesg --time-format iso (comma fraction) and journalctl -o short-iso[-precise] / RFC 3339 syslog
_ISO = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?) ")
# Possessive \S++: a long word that is not followed by a space fails at once instead of being given back
# character by character.
_SYSLOG_TIME = r"([A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d)"
_SYSLOG = re.compile(_SYSLOG_TIME + r" (\S++) ")  # "Jan 01 09:30:56 host "
_HOST_KERNEL = r"\S++ kernel: "
_HOST_KERNEL_RE = re.compile(_HOST_KERNEL)  # journal/syslog "host kernel: " after the timestamp
# Lines joined by newlines, each read in one findall as classify_line reads a line that starts with a dmesg stamp and
# has no journal host after it: (secs, frac, message), and ("", "", line) for any other line. The space after the
# stamp is taken possessively, as _DMESG_STAMP_RE.match takes it before _HOST_KERNEL_RE is tried where it ends.
DMESG_LINES = re.compile(r"^(?:" + _STAMP + r" ?+(?!" + _HOST_KERNEL + r"))?+(.*)$", re.M)
# The same for the other text forms a saved log is usually in, one pattern a form: each reads a line that starts so as
# classify_line's steps do (each step a match from where the last ended, which possessive quantifiers reproduce):
# (the time as written, the kernel's own secs and frac after a journal's "host kernel: ", the message); a line the
# pattern does not take is ("", "", "", line), for classify_line. A journal's or syslog's host is not kept
# (classify_line does not return it).
_KERNEL_STAMP = r"(?:" + _STAMP + r" ?+)?+"
FORM_LINES = {
    "dmesg-ctime": re.compile(r"^(?:" + _CTIME.pattern + r"(?:" + _HOST_KERNEL + _KERNEL_STAMP + r")?+)?+(.*)$",
                              re.M),
    "dmesg-iso": re.compile(r"^(?:" + _ISO.pattern + r"(?:" + _HOST_KERNEL + _KERNEL_STAMP + r")?+)?+(.*)$", re.M),
    "syslog": re.compile(r"^(?:" + _SYSLOG_TIME + r" \S++ (?:kernel: )?+" + _KERNEL_STAMP + r")?+(.*)$", re.M),
}
# A kernel line quoted inside other text ("mynode-066 | ERROR: ... [ 3606.832215] NVRM: Xid ..."):
# only NVIDIA driver lines are looked for, so ordinary text is not cut at a stray "[1.5]".
# Found by its fixed text first (a C substring scan); a pattern with an optional stamp in front cannot skip ahead,
# and tried at every position it took ~0.2 s per MiB of a long line. The stamp is the one ending where it starts.
_EMBEDDED = re.compile(r"NVRM: |nvidia-nvswitch\d++: ")
_EMBEDDED_STAMP = re.compile(r"\[ *+(\d{1,12})\.(\d{1,9})\] ")


def stamp_usec(secs: str, frac: str) -> int:
    """"[ 1234.5678]" -> 1234567800: the seconds' digits then the fraction's first six, as one number (one int()
    of the joined digits; both are digits only, as the stamp patterns match them)."""
    return int(secs + (frac + "000000")[:6])


def classify_line(line: str) -> tuple[str, str, str | None, int | None, int | None, int | None]:
    """One line -> (format, message, timestamp, usec, priority, seq)."""
    s = line.lstrip()
    # The first character rules out most shapes before a regex is tried (isdigit and islower hold for every
    # character \d and [a-z] match, and more).
    m = _KMSG.match(s) if s[:1].isdigit() else None
    if m:
        p = int(m[1])
        return "kmsg", s[m.end():], None, int(m[3]), p & 7, int(m[2])
    priority = None
    fmt = ""
    m = _DECODE.match(s) if s[:1].islower() else None
    if m and m[2] in _LEVELS:
        priority, s, fmt = _LEVELS[m[2]], s[m.end():], "dmesg-decode"
    timestamp = usec = None
    kind = ""
    if s.startswith("["):
        m = _DMESG_STAMP_RE.match(s)
        if m:
            usec, kind, s = stamp_usec(m[1], m[2]), "dmesg", s[m.end():]
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
        m = _HOST_KERNEL_RE.match(s)
        if m:
            s = s[m.end():]
            kind = "journal-iso" if kind == "dmesg-iso" else "journal"
    if kind in ("syslog", "journal-iso", "journal") and s.startswith("["):
        m = _DMESG_STAMP_RE.match(s)  # kern.log keeps the kernel's own "[secs.frac]" after "kernel: "
        if m:
            usec, s = stamp_usec(m[1], m[2]), s[m.end():]
    if kind:
        if fmt and kind.startswith("dmesg"):
            kind = fmt + kind[5:]
        return kind, s, timestamp, usec, priority, None
    if fmt:  # dmesg --decode --notime
        return fmt, s, None, None, priority, None
    if "NVRM: " in s or "nvidia-nvswitch" in s:
        m = _EMBEDDED.search(s)
        if m and m.start() > 0:
            at = s.rfind("[", 0, m.start())  # a stamp holds no other "["
            stamp = _EMBEDDED_STAMP.fullmatch(s, at, m.start()) if at >= 0 else None
            return "embedded", s[m.start():], None, stamp_usec(stamp[1], stamp[2]) if stamp else None, None, None
    return "plain", line, None, None, None, None


HEAD_LINES = 2000  # the format is voted by the first lines of a text ...
HEAD_CHARS = 1 << 20  # ... within its first characters: a file of huge lines is not read whole to name its format


def format_votes(text: str) -> Counter[str]:
    """How many of the first HEAD_LINES non-blank lines (within HEAD_CHARS characters) of ``text`` have each
    line format (kmsg continuation lines do not vote)."""
    votes: Counter[str] = Counter()
    for line in text[:HEAD_CHARS].split("\n", HEAD_LINES)[:HEAD_LINES]:
        if line.strip():
            fmt = classify_line(line)[0]
            if not (fmt == "plain" and line[0] == " "):
                votes[fmt] += 1
    return votes


def detect_format(text: str) -> str:
    """The dominant line format of ``text``: kmsg, dmesg, dmesg-ctime, dmesg-iso, dmesg-decode[-iso|-ctime],
    journal, journal-iso, syslog, embedded, plain (nothing recognised) or empty."""
    return format_of_votes(format_votes(text))


def format_of_votes(votes: Counter[str]) -> str:
    """detect_format from format_votes."""
    if not votes:
        return "empty"
    # Raw kmsg turns every other line into an error, so it must hold the majority, not just lead: a
    # document quoting one kmsg record among prose is text.
    if votes["kmsg"] * 2 > sum(votes.values()):
        return "kmsg"
    known = [(n, f) for f, n in votes.items() if f not in ("plain", "kmsg")]
    return max(known)[1] if known else "plain"


def parse_line(line: str, lineno: int, source: str, kmsg: bool) -> LogRecord | ParseError | None:
    """One line (no newline; a CRLF's CR removed) exactly as parse_log_text reads it at line ``lineno`` of a text of
    that format (raw kmsg or not): its record, the ParseError of a malformed kmsg record, or None (a blank line, a
    kmsg continuation line)."""
    if kmsg:
        prio, seq, usec, message = KMSG_ROW.match(line).groups()  # type: ignore[union-attr]  # always matches
        if prio:
            return kmsg_record(message, lineno, source, prio, seq, usec)
        if message and message[0] != " ":
            return kmsg_line(message, source, lineno)
        return None
    if line and not line.isspace():
        _, message, timestamp, usec, priority, seq = classify_line(line)
        r = LogRecordBuilder(message, lineno, source, seq, usec, priority, timestamp, None)
        r.__class__ = LogRecord
        return r
    return None


def parse_log_text(text: str, source: str) -> tuple[list[LogRecord], list[ParseError]]:
    """Parse kernel log text of any supported format, detected per line (raw kmsg as a whole)."""
    if detect_format(text) == "kmsg":
        return parse_kmsg_text(text, source)
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    records: list[LogRecord] = []
    with gc_paused():
        for lineno, line in enumerate(text.split("\n"), 1):
            if line and not line.isspace():
                _, message, timestamp, usec, priority, seq = classify_line(line)
                records.append(LogRecord(message, lineno, source, seq, usec, priority, timestamp))
    return records, []
