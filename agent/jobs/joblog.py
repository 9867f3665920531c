"""Reading a distributed job's logs: the lines of PyTorch's ProcessGroupNCCL, NCCL's own WARN/INFO lines, torchrun's
failure summary and srun/slurmstepd that say which rank stalled, which peer failed, which host and GPU each rank ran
on, and what failed first. What each line means is in `joblog_lines` (the patterns); here is only the reading.

Linear and bounded: a file is read in buffers and only the lines that hold one of the patterns' fixed texts are
decoded (`agent/core/line_search.py`, at C speed; a 1M-line log costs a few times `grep -c` of it, see bench/README.md);
a line longer than LINE_MAX is cut (and said so), a file past MAX_BYTES or a read past the deadline stops there
with a note, at most MAX_EVENTS events are kept. A path that is not a regular file (a FIFO, /dev/zero) is refused:
it may never end. Nothing here raises for what a file holds: a binary file, NULs or a line cut mid-way read as
lines that match nothing.

Lines prefixed by launchers (`[rank3]:`, `[default3]:`, mpirun's `[1,3]<stdout>:` and `[56] `, srun --label's
`3: `, a collector's timestamp) read as bare ones; the prefix gives the line's rank where the line does not."""
from __future__ import annotations

import io
import os
import stat
import time
from pathlib import Path
from typing import Any, BinaryIO, Sequence

from gpuwarden.agent.core.line_search import ProbeMemory, gather_counting, new_repeats, probes_for
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs import joblog_lines
from gpuwarden.agent.jobs.joblog_floods import Flood as _Flood
from gpuwarden.agent.jobs.joblog_floods import key as _key
from gpuwarden.agent.jobs.joblog_floods import significant as _significant
from gpuwarden.agent.jobs.joblog_prefix import tag_context
from gpuwarden.agent.jobs.joblog_wrap import starts_record as _starts_record
from gpuwarden.agent.jobs.joblog_wrap import wrap_width as _wrap_width

CHUNK = 1 << 20
LINE_MAX = 64 << 10  # a longer line is cut to this (a job log's longest real lines, tracebacks' frames, are < 4 KiB)
MAX_BYTES = 16 << 30  # a job log past this is read up to it, with a note
MAX_EVENTS = 200_000  # events kept per file (a 72-rank job's init lines are a few thousand)
DEADLINE_S = 300.0  # reading one file stops here, with a note: the rest of the evidence still counts
KEEP_FIRST = 3  # lines kept of one kind from one rank (with its last)
TEXT_MAX = 400  # characters of a line kept as evidence
MADE_MAX = 4096  # lines whose meaning is kept for their repeats (at most MADE_LINE_MAX bytes each: ~4 MiB)
MADE_LINE_MAX = 1024

_PROBES = probes_for(joblog_lines.NEEDLES)


@dataclass(frozen=True)
class LogEvent:
    """One line that says something, with where it is. `fields`: what the line says (joblog_lines names them);
    host/pid/dev: NCCL's `host:pid:tid [dev]` prefix; rank: the global rank the line's launcher prefix gives
    (`[rank3]:`, mpirun's tag), local_rank torchrun's `[default3]:`; stamp: (clock, seconds) of a time the line
    carries, comparable only within one clock ("glog" has no year)."""

    kind: str
    source: str
    line: int
    text: str
    fields: dict[str, Any]
    host: str | None = None
    pid: int | None = None
    dev: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    stamp: tuple[str, float] | None = None

    def where(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass(frozen=True)
class JobLog:
    """What one file said. `error`: why it could not be read at all (then there are no events); `notes`: what was
    cut or skipped (a long line, the deadline)."""

    source: str
    lines: int
    events: tuple[LogEvent, ...]
    notes: tuple[str, ...] = ()
    error: str | None = None
    wrapped: int | None = None  # the terminal width the file's lines were hard-wrapped at, where they were


def read_job_log(path: Path | str, deadline_s: float = DEADLINE_S, max_bytes: int = MAX_BYTES) -> JobLog:
    source = str(path)
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return JobLog(source, 0, (), error=f"{source}: cannot open: {exc.strerror or exc}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return JobLog(source, 0, (), error=f"{source}: not a regular file (a FIFO, device or folder may never "
                                               "end): save the log to a file first")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            return _read(f, source, time.monotonic() + deadline_s, max_bytes)
    except OSError as exc:
        return JobLog(source, 0, (), error=f"{source}: read failed: {exc.strerror or exc}")
    finally:
        os.close(fd)


def read_job_file(f: BinaryIO, source: str, deadline_s: float = DEADLINE_S, max_bytes: int = MAX_BYTES) -> JobLog:
    """The same reading of a regular file already open, from where it stands (`analyze`'s, standard input's copy)."""
    return _read(f, source, time.monotonic() + deadline_s, max_bytes)


def read_text(text: str, source: str = "<text>") -> JobLog:
    """The same reading of a log held in memory (tests, and `analyze` of a file already read)."""
    return _read(io.BytesIO(text.encode()), source, time.monotonic() + DEADLINE_S, MAX_BYTES)


def _read(f: BinaryIO, source: str, deadline: float, max_bytes: int) -> JobLog:
    reader = _Reader(source)
    # One buffer for the whole file, read into (not a fresh bytes a chunk, copied on: 85 ms of a 157 MB log): a
    # partial line carried at its front, a chunk after it, and room for the newline a file cut mid-line is given.
    buf = bytearray(2 * CHUNK + LINE_MAX + 1)
    view = memoryview(buf)
    have = 0  # bytes in buf: the lines not yet read, none of them complete but the last
    memory = ProbeMemory()
    lineno = 0  # lines before buf[0]
    total = 0
    eof = False
    first = True
    while not eof:
        if time.monotonic() > deadline:
            reader.notes.append(f"{source}: stopped reading at line {lineno + 1}: the read took longer than "
                                f"{DEADLINE_S:.0f} s")
            break
        want = min(CHUNK, max_bytes - total)
        n = (f.readinto(view[have:have + want]) or 0) if want > 0 else 0
        if want <= 0:
            reader.notes.append(f"{source}: read up to {max_bytes} bytes, the rest is not looked at")
        if not n:
            eof = True
            if have and buf[have - 1] != 0x0A:
                buf[have] = 0x0A  # a file cut mid-line: its last line reads as a line
                have += 1
        else:
            total += n
            have += n
        if first and have:
            first = False
            reader.wrap = _wrap_width(bytes(view[:min(have, CHUNK)]))
        stop = buf.rfind(b"\n", 0, have) + 1
        if stop:
            lineno = reader.take(buf, stop, lineno, memory)
            buf[:have - stop] = bytes(view[stop:have])  # a copy: the two overlap (a part of a line, short)
            have -= stop
            if len(reader.events) >= MAX_EVENTS:
                reader.notes.append(f"{source}: more than {MAX_EVENTS} lines of interest; those after line "
                                    f"{lineno} are not looked at")
                break
        if have > LINE_MAX:  # one line longer than LINE_MAX: keep its start, skip to its end
            rest, lineno = _skip_long(f, bytearray(view[:have]), lineno, reader, source)
            buf[:len(rest)] = rest
            have = len(rest)
    reader.flush(lineno)
    reader.tag_check()
    return JobLog(source, lineno, tuple(reader.events), tuple(reader.notes), wrapped=reader.wrap)


def _skip_long(f: BinaryIO, buf: bytearray, lineno: int, reader: "_Reader", source: str) -> tuple[bytearray, int]:
    head = bytes(buf[:LINE_MAX])
    skipped = len(buf)
    while True:
        data = f.read(CHUNK)
        if not data:
            rest = b""
            break
        nl = data.find(b"\n")
        if nl >= 0:
            rest = data[nl + 1:]
            skipped += nl
            break
        skipped += len(data)
    reader.notes.append(f"{source}:{lineno + 1}: a line of {skipped} bytes, longer than {LINE_MAX}: only its start "
                        "is read")
    reader.take(bytearray(head + b"\n"), len(head) + 1, lineno, None)
    return bytearray(rest), lineno + 1


class _Reader:
    def __init__(self, source: str):
        self.source = source
        self.events: list[LogEvent] = []
        self.notes: list[str] = []
        self.wrap: int | None = None
        self.state = joblog_lines.BlockState()
        self._floods: dict[tuple, _Flood] = {}  # by _key
        self._open: list[_Flood] = []  # the floods past their first KEEP_FIRST lines: their last is made at flush
        self._made: dict[bytes, list] = {}  # what a line meant, by its bytes (_line): [text, events, registered]
        # Lines counted in C (agent/core/_repeats.h), where it is built: those whose every flood is past its first
        # lines, with the lines of their shape that hold the same digits where the floods' keys were read (_register)
        self._repeats = new_repeats(MADE_MAX, MADE_LINE_MAX)
        self._known: list[list] = []  # what each registered line meant, by the number it was registered under

    def take(self, buf: bytearray, stop: int, lineno: int, memory: ProbeMemory | None) -> int:
        """Parses the lines of interest of buf[:stop] (complete lines); returns the line count after them."""
        if self.wrap:
            return self._take_wrapped(buf, stop, lineno)
        # The lines found, their numbers and the newlines of the buffer in one pass of C (line_search.gather): no
        # count of the newlines between two found lines in Python (75 ms of a 157 MB log with few such lines). The
        # lines _register gave it are counted there, not handed on; `befores` keeps state.lines a count of every
        # line found, as parse counts it (see _line).
        joined, numbers, newlines, befores, found = gather_counting(buf, 0, stop, _PROBES, lineno, self._repeats,
                                                                    memory)
        state = self.state
        base = state.lines
        if numbers:
            made, add = self._made.get, self._add
            for raw, n, before in zip(joined.split(b"\n"), numbers, befores, strict=True):
                known = made(raw)  # _line, inline: most lines of a flood are met before
                if known is None:
                    state.lines = base + before
                    self._parse_line(raw, n)
                else:
                    state.lines = base + before + 1
                    add(known[1], known[0], n)
                    if not known[2]:
                        self._register(raw, known)
        state.lines = base + found
        return lineno + newlines

    def _take_wrapped(self, buf: bytearray, stop: int, lineno: int) -> int:
        """A hard-wrapped file: a line exactly `wrap` wide goes on in the next, unless that one opens a record of
        its own; each logical line is read whole, under the number of its first physical line."""
        n = lineno
        joined: list[bytes] = []
        first = 0
        for raw in bytes(buf[:stop]).split(b"\n")[:-1]:
            n += 1
            piece = raw.rstrip(b"\r")
            if joined and (len(joined[-1]) != self.wrap or _starts_record(piece)):
                self._logical(joined, first)
                joined = []
            if not joined:
                first = n
            joined.append(piece)
        if joined:
            self._logical(joined, first)
        return n

    def _logical(self, pieces: list[bytes], lineno: int) -> None:
        logical = b"".join(pieces)
        if any(needle in logical for needle in joblog_lines.NEEDLES):
            self._line(logical, lineno)

    def _line(self, raw: bytes | bytearray, lineno: int) -> None:
        # A line met before (a flood of one warning, a log joined from its repeats) means what it meant then: its
        # events are taken from then, where the line's meaning depends on no other (joblog_lines.reads_block).
        made = self._made.get(raw)
        if made is None:
            self._parse_line(raw, lineno)
        else:
            self.state.lines += 1  # as parse counts it: a desync report's rank lines are looked for in its next lines
            self._add(made[1], made[0], lineno)

    def _parse_line(self, raw: bytes | bytearray, lineno: int) -> None:
        """A line not met before: parsed, and its meaning kept for its repeats where it depends on no other line."""
        made = self._meaning(raw, lineno, self.state)
        self._add(made[1], made[0], lineno)
        if len(raw) <= MADE_LINE_MAX and not joblog_lines.reads_block(made[0]):
            if len(self._made) < MADE_MAX:
                self._made[bytes(raw)] = made
            self._register(raw, made)

    def _meaning(self, raw: bytes | bytearray, lineno: int, state: joblog_lines.BlockState) -> list:
        """[text, events, registered] of one line, each event (flood, kind, fields, context)."""
        text = bytes(raw).decode("utf-8", "replace").rstrip("\r")
        state.lineno = lineno
        return [text, [(self._flood(kind, fields, ctx), kind, fields, ctx)
                       for kind, fields, ctx in self._tagged(joblog_lines.parse(text, state), text)], False]

    def _register(self, raw: bytes | bytearray, made: list) -> None:
        """A line whose every event's flood is past its first lines and has its last in place (it adds nothing but,
        perhaps, a flood's last line): from the next buffer on, the C search counts it, with each line of its shape
        that holds its digits where its floods' keys were read, and keeps only the last (agent/core/_repeats.h:
        why a line of one shape means what this one does). flush reads that last."""
        if self._repeats is None:
            made[2] = True
            return
        if any(flood.slot < 0 for flood, *_ in made[1]):
            return
        made[2] = True
        if self._repeats.add(bytes(raw), _significant(raw, made[1]), len(self._known)):
            self._known.append(made)

    @staticmethod
    def _tagged(events: list, text: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """The events with what a `[N] ` / `N: ` tag at the line's start says (a rank, unless the file shows it
        counts lines: tag_check)."""
        if not events:
            return events
        tag = tag_context(text)
        if not tag:
            return events
        out = []
        for kind, fields, ctx in events:
            fields = {**fields, **tag}
            if ctx.get("rank") is None:
                ctx = {**ctx, "rank": tag["_tag"]}
                fields["_rank_from"] = "tag"
            out.append((kind, fields, ctx))
        return out

    def _flood(self, kind: str, fields: dict[str, Any], ctx: dict[str, Any]) -> "_Flood":
        key = _key(kind, fields, ctx)
        flood = self._floods.get(key)
        if flood is None:
            flood = self._floods[key] = _Flood()
        return flood

    def _add(self, events: Any, text: str, lineno: int) -> None:
        """events: (flood, kind, fields, context) of each event of one line."""
        for flood, kind, fields, ctx in events:
            # A flood of one kind of line from one rank adds nothing past its first lines and its last: those are
            # kept (the last in place of the one before), so memory is bounded by the ranks and kinds, not the lines.
            # The last is made an event only at the end (most lines of a flood are replaced by the next). The flood
            # is resolved once per distinct line (_parse_line), not looked up by its key at each repeat.
            seen = flood.seen
            flood.seen = seen + 1
            if seen < KEEP_FIRST:
                self.events.append(self._event(kind, fields, ctx, text, lineno))
            else:
                if seen == KEEP_FIRST:
                    flood.slot = len(self.events)
                    self.events.append(None)
                    self._open.append(flood)
                flood.pending = (kind, fields, ctx, text, lineno)

    def _event(self, kind: str, fields: dict[str, Any], ctx: dict[str, Any], text: str, lineno: int) -> LogEvent:
        return LogEvent(kind, self.source, fields.get("_line", lineno), _short(fields.get("_text", text)), fields,
                        **ctx)

    def flush(self, lineno: int) -> None:
        for ident, count, number, line in self._repeats.hits() if self._repeats is not None else ():
            self._last_counted(self._known[ident][1], count, number, line)
        self._add([(self._flood(*e), *e) for e in self._tagged(joblog_lines.flush(self.state), "")], "", lineno)
        for flood in self._open:
            self.events[flood.slot] = self._event(*flood.pending)
        self._open.clear()

    def _last_counted(self, registered: list, count: int, number: int, line: bytes) -> None:
        """The last of `count` lines the C search counted for a registered line: its floods' last, where it came
        after theirs."""
        text, events, _ = self._meaning(line, number, joblog_lines.BlockState())
        if [flood for flood, *_ in events] != [flood for flood, *_ in registered]:
            # Not the floods of the line it was counted for (a pattern that tells digits apart, which
            # tests/test_explain_repeats.py guards the patterns against): read as a line of its own, after the others.
            self._add(events, text, number)
            return
        for flood, kind, fields, ctx in events:
            flood.seen += count
            if number > flood.pending[4]:
                flood.pending = (kind, fields, ctx, text, number)

    def tag_check(self) -> None:
        """A `[N] ` tag in front of every line is mpirun's rank, unless it counts the file's lines (a paste's line
        numbers): then it says nothing of ranks and is dropped."""
        tagged = [e for e in self.events if e.fields.get("_tag") is not None]
        if len(tagged) >= 2 and len({e.fields["_tag"] - e.line for e in tagged}) == 1:
            self.events = [_untag(e) for e in self.events]
        self.events = [_drop_tag(e) for e in self.events]


def _untag(e: LogEvent) -> LogEvent:
    if e.fields.get("_tag") is None or e.fields.get("_rank_from") != "tag":
        return e
    return LogEvent(e.kind, e.source, e.line, e.text, e.fields, e.host, e.pid, e.dev, None, e.local_rank, e.stamp)


def _drop_tag(e: LogEvent) -> LogEvent:
    if "_tag" in e.fields or "_rank_from" in e.fields:
        fields = {k: v for k, v in e.fields.items() if not k.startswith("_")}
        return LogEvent(e.kind, e.source, e.line, e.text, fields, e.host, e.pid, e.dev, e.rank, e.local_rank,
                        e.stamp)
    return e


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= TEXT_MAX else text[:TEXT_MAX - 3] + "..."


def read_all(paths: Sequence[Path | str]) -> list[JobLog]:
    return [read_job_log(p) for p in paths]
