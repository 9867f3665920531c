"""The reader processes of a large kernel log (agent/node/kernel_scan.py): forked, one per CPU up to MAX_WORKERS, each
taking the next part's number from a pipe, reading that part (kernel_scan_lines' `_read_part`) and sending its rows
back (marshal, through a pipe of its own); this process takes the results in file order. A reader that fails (an
exception, an exit, a signal) is a ScanError naming the file and the part's bytes."""
from __future__ import annotations

import gc
import marshal
import mmap
import os
import select
import signal
import struct
from typing import Any, Callable

from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.line_search import ProbeMemory

# Part numbers handed to the readers past the part being judged, as many as their pipe takes (4 bytes each; a pipe
# holds 64 KiB): the readers do not wait for this process to hand them more while it is busy (loading the checks,
# or the CLI). What the readers read ahead is bounded by their result pipes, not by this.
HANDED_AHEAD = 1 << 14
READER_NICE = 5  # the readers' niceness, above this process's
PIPE_SIZE = 1 << 20  # bytes a reader's pipe holds (Linux's default pipe-max-size)
# Bytes of results a reader holds itself once its pipe is full, reading on meanwhile: while this process loads the
# checks (a few tens of ms) it takes nothing, and a log dense in XIDs (1M lines, 10 % of them) has more results
# than the pipes hold. Past this the reader waits, so that memory stays flat in the file's size.
OUTBOX_BYTES = 4 << 20


class ScanError(GpuwardenError):
    """The file was not read whole: a process reading a part of it failed. Names the file and the part."""


class _NoFork(Exception):
    """A reader process could not be started."""


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


def _widen(fd: int) -> None:
    """A pipe that holds a part's result: its reader goes on to its next part while this process judges."""
    try:
        import fcntl  # optional dependency: not on every platform (ImportError below)

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
    outbox: _Outbox | None = None
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
        outbox = _Outbox(out)
        while number := os.read(claims, _PART_NO.size):
            i = _PART_NO.unpack(number)[0]
            held[at:at + _HELD.size] = _HELD.pack(i)
            start, stop = parts[i]
            result = read_part(fd, start, stop, i == last, kmsg, needles, probes, buf, chunk, line_max, memory)
            outbox.send(("part", i, result))
            held[at:at + _HELD.size] = _HELD.pack(-1)
            i = -1
        outbox.flush()
        code = 0
    except BaseException as exc:  # noqa: BLE001  # any failure is reported to the parent, which names the file
        try:
            os.set_blocking(out, True)
            if outbox is not None:
                outbox.flush()  # the parts read before it, in order
            _send(out, ("error", i, f"{type(exc).__name__}: {exc}"))
        except BaseException:  # noqa: BLE001  # the parent is gone or the pipe is broken: the exit status says it
            pass
    finally:
        os._exit(code)
_HEADER = struct.Struct("<Q")


def _send(fd: int, message: tuple[Any, ...]) -> None:
    body = marshal.dumps(message)
    for data in (memoryview(_HEADER.pack(len(body))), memoryview(body)):  # not joined: a copy of a part's result
        while data:
            data = data[os.write(fd, data):]


class _Outbox:
    """A reader's results on their way to this process, in order: written as far as the pipe takes them without
    waiting, the rest held here (up to OUTBOX_BYTES, then waited for) while the reader reads its next part."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.queue: list[memoryview] = []
        self.held = 0
        os.set_blocking(fd, False)

    def send(self, message: tuple[Any, ...]) -> None:
        body = marshal.dumps(message)
        self.queue += [memoryview(_HEADER.pack(len(body))), memoryview(body)]  # not joined: a copy of the result
        self.held += _HEADER.size + len(body)
        self._write()
        while self.held > OUTBOX_BYTES:
            select.select([], [self.fd], [])
            self._write()

    def flush(self) -> None:
        while self.queue:
            select.select([], [self.fd], [])
            self._write()

    def _write(self) -> None:
        while self.queue:
            data = self.queue[0]
            try:
                n = os.write(self.fd, data)
            except BlockingIOError:
                return
            self.held -= n
            if n < len(data):
                self.queue[0] = data[n:]
                return
            self.queue.pop(0)


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
