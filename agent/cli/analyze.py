"""`gpuwarden analyze FILE…`: the post-mortem tool. Decides what each saved file is from its head (a kernel log in
any of dmesg / journalctl / syslog / raw kmsg forms, or a tool's output) and reports the findings the checks' own
decisions give.

- A file most of whose first lines are kernel-log lines is a kernel log; otherwise the checks' analyzers are asked,
  in check order, whether the head (its first kernel_log.HEAD_CHARS characters) is their tool's output, and a file
  none of them reads is read as a kernel log too (any text may hold the driver's lines).
- A kernel log of any size is streamed (agent/node/kernel_scan.py: fixed chunks, the checks' lines found by substring
  search, only those parsed; a large file's parts read by one process per CPU and judged here in order), in flat
  memory, with the findings of a parse of the whole file. A reader process that fails makes the file UNKNOWN.
- A tool's output is read whole up to TOOL_MAX bytes; a larger one is UNKNOWN, naming the file and the limit (no
  real nccl-tests, perftest or dcgmi output comes near it).
- Only a regular file is read (a FIFO, a device or a folder may never end: refused, as job logs are). `-` is
  standard input, copied first into an unnamed temporary file, up to STDIN_MAX bytes and for STDIN_DEADLINE_S
  seconds, then read as that file is: a stream that goes on past either (`yes`, `journalctl -f`) is UNKNOWN,
  naming it, with nothing judged. A standard input that is a regular file (`- < dmesg.txt`) is read as that file.
How, and what a streamed read validates: docs/analyze.md.
"""
from __future__ import annotations

import math
import os
import select
import stat
import time
from pathlib import Path  # loaded with the interpreter's start (site), 0 ms here
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable

from gpuwarden.agent.cli.flags import exit_codes_epilog, log_flags
from gpuwarden.agent.cli.verdict import emit
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.kernel_log import HEAD_CHARS, HEAD_LINES, format_of_votes, format_votes
from gpuwarden.agent.node.kernel_scan import read_head, scan  # what read_ahead and analyze_file do first

if TYPE_CHECKING:
    import argparse
    from collections import Counter

    from gpuwarden.agent.core.model import CheckResult, Report  # at use: +10 ms, after the readers start

TOOL_MAX = 16 << 20  # bytes of a tool's output that are read
STDIN = "-"  # the FILE that names standard input
# Standard input is bounded as a file is by its size: a node's whole kernel ring buffer (dmesg) is a few MiB and a
# month of `journalctl -k` a few hundred; a longer log is saved to a file, which is read in parts and unbounded.
STDIN_MAX = 1 << 30  # bytes
STDIN_DEADLINE_S = 300.0  # for a writer that neither ends nor writes (`journalctl -kf`, `sleep inf |`)
_STDIN_CHUNK = 1 << 20
# The texts the kernel-log checks read (the interest of _kernel_consumers(), which a test holds them to), known
# before the checks are loaded: the readers of a large file start while they load.
KERNEL_INTEREST = ("Xid", "NVRM: GPU at ", "SXid", "NVSwitch")
VOTE_CHARS = 1 << 18  # characters of the head read first: HEAD_LINES kernel-log lines of up to ~130 characters
# Line formats that only a kernel log has (one a line); "plain" and "embedded" (a driver line quoted in other text)
# are not among them.
_KERNEL_FORMATS = frozenset(("kmsg", "dmesg", "dmesg-ctime", "dmesg-iso", "dmesg-decode", "dmesg-decode-ctime",
                             "dmesg-decode-iso", "journal", "journal-iso", "syslog"))


def _kernel_consumers() -> tuple[Any, ...]:
    from gpuwarden.checks import log_readers  # at use: the checks, +62 ms before a large file's readers start

    return log_readers()  # the concerns that say they read a saved kernel log (Concern.analyze), in report order


DESCRIPTION = ("Judge saved files with the decision code the live checks use: kernel logs (dmesg, journalctl, "
               "syslog or raw kmsg: XIDs, NVSwitch SXids) and the outputs of dcgmi diag (text or JSON), "
               "nccl-tests and perftest (ib_write_bw). Nothing on this machine is read.")
EPILOG = ("examples:\n"
          "  gpuwarden analyze dmesg.txt\n"
          "  gpuwarden analyze --json node17/*.log\n"
          "  ssh node17 dmesg | gpuwarden analyze -\n\n"
          + exit_codes_epilog())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",  # a str: Path("./-") would be "-", standard input
                   help="saved kernel log or tool output, a regular file (a FIFO or device is refused); the format "
                        "is recognised from the content. - reads standard input, up to 1 GiB and for 300 s")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    log_flags(p)


def run(args: argparse.Namespace) -> int:
    if args.files.count(STDIN) > 1:
        raise GpuwardenError(f"{STDIN} (standard input) is given more than once: it can be read only once")
    logs.setup(args.log_format or "auto", args.log_level or "info")
    # A str for STDIN, a Path for every other FILE: Path("./-") would be "-", standard input.
    return emit(analyze(STDIN if f == STDIN else Path(f) for f in args.files), args.json)

# ---------------------------------------------------------------- a large kernel log's readers, started first
# The command line's first FILE, when it is a large kernel log, has its readers started before the command line is
# parsed and the CLI loaded (what the installed command does first: agent/cli/command.py); `analyze` then takes them
# up when it comes to that file (agent/cli/analyze_ahead.py starts them). What is read ahead is the file's head, as
# analyze_file reads it, and nothing else is done before the CLI has judged the command line: a command line it
# refuses ends the readers unused.
_AHEAD: dict[str, tuple[BinaryIO, bytes, str, Any, float]] = {}  # the FILE as written -> (file, head, format,
#                                                                   its readers, when its reading started)


def _take_ahead(path: Path) -> tuple[BinaryIO, bytes, str, Any, float] | None:
    for arg in _AHEAD:
        if Path(arg) == path:
            return _AHEAD.pop(arg)
    return None


def _kernel_lines_lead(votes: dict[str, int]) -> bool:
    return sum(n for fmt, n in votes.items() if fmt in _KERNEL_FORMATS) * 2 > sum(votes.values())


def _open_nonblocking(path: str | Path) -> BinaryIO:
    """The file, opened without waiting: a FIFO put in its place since it was looked at does not hold the open up
    for a writer (its reads are refused after, on its fstat)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.set_blocking(fd, True)
        return open(fd, "rb")  # noqa: SIM115  # the caller's to close
    except BaseException:
        os.close(fd)
        raise


def _not_regular(path: Path, st: Any) -> str | None:
    """Why `path` (stat ``st``) is not read, or None for a regular file. The rule and the words of job logs'
    (agent/jobs/joblog.py read_job_log): a FIFO, a device or a folder may never end."""
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISDIR(st.st_mode):
        return f"{path}: a folder, not a regular file: name the files in it (gpuwarden analyze {path}/*)"
    return (f"{path}: not a regular file (a FIFO, device or folder may never end): save the log to a file first, "
            f"or pipe it to `gpuwarden analyze -` (read up to {_size(STDIN_MAX)}, for {STDIN_DEADLINE_S:g} s)")


def _size(n: int) -> str:
    if n >= 1 << 30 and not n % (1 << 30):
        return f"{n >> 30} GiB"
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


def _unknown(path: Path | str, error: str, start: float, source: str | None = None) -> CheckResult:
    from gpuwarden.agent.core.model import CheckResult, Status  # at use: +10 ms, after the readers start

    return CheckResult("analyze", Status.UNKNOWN, error=error, duration_s=time.monotonic() - start,
                       source=source or str(path))


def analyze_file(path: Path) -> CheckResult:
    # The model is loaded after a large file's readers have started (kernel_scan), not before: the start is what
    # the readers wait for.

    start = time.monotonic()
    ahead = _take_ahead(path)  # its readers started before the CLI loaded (read_ahead)
    try:
        if ahead is not None:
            f, head, fmt, readers, start = ahead
            with f:
                return _kernel_log(path, f, head, fmt, start, readers)
        try:
            # Looked at before it is opened: the open of a device may act (a tape rewinds, a watchdog arms).
            why = _not_regular(path, os.stat(path))
            if why is None:
                f = _open_nonblocking(path)
                why = _not_regular(path, os.fstat(f.fileno()))
                if why is not None:
                    f.close()
        except OSError as exc:
            return _unknown(path, f"{path}: cannot read: {exc.strerror or exc}", start)
        if why is not None:
            return _unknown(path, why, start)
        with f:
            return _analyze_open(path, f, start)
    except OSError as exc:
        return _unknown(path, f"{path}: cannot read: {exc.strerror or exc}", start)
    except GpuwardenError as exc:  # kernel_scan_readers.ScanError: a process reading a part of it failed
        return _unknown(path, str(exc), start)


def analyze_stdin(fd: int = 0, max_bytes: int = STDIN_MAX, deadline_s: float = STDIN_DEADLINE_S) -> CheckResult:
    """`gpuwarden analyze -`: standard input (``fd``), judged as the file it would be saved to. What is read of it
    is bounded: ``max_bytes``, within ``deadline_s``; a stream that goes on past either is UNKNOWN, naming it."""
    start = time.monotonic()
    path = Path(STDIN)
    source = f"{STDIN} (standard input)"
    try:
        st = os.fstat(fd)
    except OSError as exc:
        return _unknown(path, f"{STDIN}: standard input cannot be read: {exc.strerror or exc}", start, source)
    try:
        if _not_regular(path, st) is None:  # `analyze - < dmesg.txt`: a file, bounded by its size
            f = open(os.dup(fd), "rb")  # noqa: SIM115  # closed below
        else:
            spooled = _spool(fd, max_bytes, deadline_s)
            if isinstance(spooled, str):
                return _unknown(path, spooled, start, source)
            f = spooled
        with f:
            return _analyze_open(path, f, start)
    except OSError as exc:  # the copy's disk (TMPDIR) full, a read error
        return _unknown(path, f"{STDIN}: standard input could not be read: {exc.strerror or exc}", start, source)
    except GpuwardenError as exc:
        return _unknown(path, str(exc), start, source)


def _spool(fd: int, max_bytes: int, deadline_s: float) -> BinaryIO | str:
    """Standard input copied into an unnamed temporary file (gone with this process however it ends), at its start;
    or why it was not: it went on past max_bytes, or had not ended by the deadline. A copy, and not a stream, so
    that it is read exactly as the file is (its head voted on, then read again from its start as a job log)."""
    import tempfile  # at use: only standard input is spooled, +10 ms to every other file

    end = time.monotonic() + deadline_s
    poll = select.poll()  # a read waits at most until the deadline, whether the writer writes or not
    poll.register(fd, select.POLLIN)
    spool = tempfile.TemporaryFile()  # noqa: SIM115  # returned open, or closed below
    try:
        total = 0
        while True:
            left = end - time.monotonic()
            if left <= 0:
                spool.close()
                return (f"{STDIN}: standard input had not ended after {deadline_s:g} s ({total} bytes read): a "
                        "stream that does not end (`journalctl -f`, `dmesg -w`) is not judged; save the log to a "
                        "file and analyze the file")
            if not poll.poll(math.ceil(left * 1000)):
                continue
            try:
                data = os.read(fd, min(_STDIN_CHUNK, max_bytes + 1 - total))
            except BlockingIOError:  # a descriptor left non-blocking by the writer's side
                continue
            if not data:
                break
            total += len(data)
            if total > max_bytes:
                spool.close()
                return (f"{STDIN}: standard input goes on past {_size(max_bytes)}, the most gpuwarden reads of "
                        "it (a stream that does not end, such as /dev/zero or `yes`?): nothing was judged; save the "
                        "log to a file and analyze the file")
            spool.write(data)
        spool.seek(0)
        return spool
    except BaseException:
        spool.close()
        raise


def _head_votes(f: BinaryIO) -> tuple[bytes, str, bool, Counter[str]]:
    """The file's head as read so far, its text, whether that is all of the head the tools' detectors read, and the
    line formats' votes over it."""
    # The vote reads the head's first HEAD_LINES lines: where a shorter head holds them (or the whole file), the rest
    # of the head is read only for the tools' detectors, which a kernel log does not need.
    head, head_text = read_head(f, VOTE_CHARS)
    whole_head = len(head_text) < VOTE_CHARS
    if not whole_head and head_text.count("\n") < HEAD_LINES:
        head, head_text = read_head(f, HEAD_CHARS, have=head)
        whole_head = True
    return head, head_text, whole_head, format_votes(head_text)


def _analyze_open(path: Path, f: BinaryIO, start: float) -> CheckResult:
    from gpuwarden.agent.core.model import Status  # at use: +10 ms, after the readers start

    head, head_text, whole_head, votes = _head_votes(f)
    if not _kernel_lines_lead(votes):
        from gpuwarden.checks import ALL  # at use: +62 ms, only for a file not a kernel log

        if not whole_head:
            head, head_text = read_head(f, HEAD_CHARS, have=head)

        for spec in ALL:
            for analyzer in spec.analyzers:
                if analyzer.detect(head_text):
                    return _tool_output(path, f, head, spec.name, analyzer.fmt, analyzer.analyze, start)
        # at use: +270 ms, job logs only
        from gpuwarden.agent.jobs.analyze_job_log import analyze_job_log, looks_like_job_log

        if looks_like_job_log(head_text):
            return analyze_job_log(path, _job_log(path, f))
    result = _kernel_log(path, f, head, format_of_votes(votes), start)
    if result.status is Status.UNKNOWN and not result.findings and result.error and "not a format" in result.error:
        # A job's log whose head is its program's own output (iterations, a traceback): the job-log reader looks
        # for its lines through the whole file.
        from gpuwarden.agent.jobs.analyze_job_log import analyze_job_log  # at use: +270 ms, job logs only

        log = _job_log(path, f)
        if log.events:
            return analyze_job_log(path, log)
    return result


def _job_log(path: Path, f: BinaryIO) -> Any:
    """The file read again from its start by the job-log reader (standard input's copy too: it has no path)."""
    from gpuwarden.agent.jobs.joblog import read_job_file  # at use: +170 ms, job logs only

    f.seek(0)
    return read_job_file(f, str(path))


def _kernel_log(path: Path, f: BinaryIO, head: bytes, fmt: str, start: float, readers: Any = None) -> CheckResult:
    """Every kernel-log check's decision over the file: XIDs and NVSwitch SXids, as preflight and the daemon judge
    them (each check's findings under its own name). ``readers``: its reader processes, started by read_ahead."""
    result = scan(f, str(path), fmt == "kmsg", _kernel_consumers, first=head, interest=KERNEL_INTEREST,
                  readers=readers)
    from gpuwarden.agent.core.model import CheckResult, Status, fold_status  # at use: +10 ms, after the readers start

    findings = result.findings
    status = fold_status(findings)
    error = None
    if result.blank:
        status, error = Status.UNKNOWN, f"{path}: empty file"
    elif fmt in ("plain", "empty") and not findings:
        # Nothing in it looked like any format gpuwarden reads (or its head is blank lines only): finding no fault
        # there means nothing.
        status, error = Status.UNKNOWN, (f"{path}: not a format gpuwarden reads (kernel log, nccl-tests, perftest, "
                                         "dcgmi diag JSON or text)")
    return CheckResult("kernel_log", status, tuple(findings), error, time.monotonic() - start,
                       source=f"{path} (kernel-log/{fmt})",
                       notes=(*(str(e) for e in result.errors), *result.notes))


def _tool_output(path: Path, f: BinaryIO, head: bytes, check: str, fmt: str, analyze: object,
                 start: float) -> CheckResult:
    from gpuwarden.agent.core.model import CheckResult, Status, fold_status  # at use: +10 ms, after the readers start

    source = f"{path} ({fmt})"
    data = head + f.read(max(0, TOOL_MAX + 1 - len(head)))
    if len(data) > TOOL_MAX:
        return CheckResult("analyze", Status.UNKNOWN, duration_s=time.monotonic() - start, source=source,
                           error=f"{path}: larger than {TOOL_MAX >> 20} MiB, the most gpuwarden reads of a tool's "
                                 f"output ({fmt}); cut it to the run to judge, or split it into one file per run")
    text = data.decode(errors="replace")
    try:
        findings, errors = analyze(text, str(path))  # type: ignore[operator]
    except GpuwardenError as exc:  # the whole file is unreadable as its format (garbage, truncated JSON)
        return CheckResult("analyze", Status.UNKNOWN, error=str(exc), duration_s=time.monotonic() - start,
                           source=source)
    return CheckResult(check, fold_status(findings), tuple(findings), None, time.monotonic() - start,
                       source=source, notes=tuple(str(e) for e in errors))


def analyze(paths: Iterable[Path | str]) -> Report:
    """Each file judged; the string STDIN is standard input (analyze_stdin), Path("-") a file of that name."""
    paths = list(paths)
    results = tuple(analyze_stdin() if isinstance(p, str) and p == STDIN else analyze_file(Path(p)) for p in paths)
    from gpuwarden.agent.core.model import Report  # at use: +10 ms, after the readers start

    return Report(node="-", results=results, source=", ".join(str(p) for p in paths), tool="analyze")
