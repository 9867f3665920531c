"""`gpuwarden analyze FILE…`: the post-mortem tool. Decides what each saved file is from its head (a kernel log in
any of dmesg / journalctl / syslog / raw kmsg forms, or a tool's output) and reports the findings the checks' own
decisions give.

- A file most of whose first lines are kernel-log lines is a kernel log; otherwise the checks' analyzers are asked,
  in check order, whether the head (its first kernel_log.HEAD_CHARS characters) is their tool's output, and a file
  none of them reads is read as a kernel log too (any text may hold the driver's lines).
- A kernel log of any size is streamed (agent/kernel_scan.py: fixed chunks, the checks' lines found by substring
  search, only those parsed; a large file's parts read by one process per CPU and judged here in order), in flat
  memory, with the findings of a parse of the whole file. A reader process that fails makes the file UNKNOWN.
- A tool's output is read whole up to TOOL_MAX bytes; a larger one is UNKNOWN, naming the file and the limit (no
  real nccl-tests, perftest or dcgmi output comes near it).
How, and what a streamed read validates: docs/analyze.md.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable

from .errors import GpuwardenError
from .kernel_log import HEAD_CHARS, HEAD_LINES, format_of_votes, format_votes

if TYPE_CHECKING:
    from .model import CheckResult, Report

TOOL_MAX = 16 << 20  # bytes of a tool's output that are read
# The texts the kernel-log checks read (the interest of _kernel_consumers(), which a test holds them to), known
# before the checks are loaded: the readers of a large file start while they load.
KERNEL_INTEREST = ("NVRM: ", "SXid", "NVSwitch")
VOTE_CHARS = 1 << 18  # characters of the head read first: HEAD_LINES kernel-log lines of up to ~130 characters
# Line formats that only a kernel log has (one a line); "plain" and "embedded" (a driver line quoted in other text)
# are not among them.
_KERNEL_FORMATS = frozenset(("kmsg", "dmesg", "dmesg-ctime", "dmesg-iso", "dmesg-decode", "dmesg-decode-ctime",
                             "dmesg-decode-iso", "journal", "journal-iso", "syslog"))


def _kernel_consumers() -> tuple[Any, ...]:
    from gpuwarden.checks import nvswitch_sxid, xid  # checks import agent: import at use, not at load

    return xid.CONSUMER, nvswitch_sxid.SXID_CONSUMER


def _kernel_lines_lead(votes: dict[str, int]) -> bool:
    return sum(n for fmt, n in votes.items() if fmt in _KERNEL_FORMATS) * 2 > sum(votes.values())


def analyze_file(path: Path) -> CheckResult:
    # The model is loaded after a large file's readers have started (kernel_scan), not before: the start is what
    # the readers wait for.
    start = time.monotonic()
    try:
        f = open(path, "rb")  # noqa: SIM115  # closed below, whichever way the file is read
    except OSError as exc:
        from .model import CheckResult, Status

        return CheckResult("analyze", Status.UNKNOWN, error=f"{path}: cannot read: {exc.strerror or exc}",
                           source=str(path))
    try:
        with f:
            return _analyze_open(path, f, start)
    except OSError as exc:
        from .model import CheckResult, Status

        return CheckResult("analyze", Status.UNKNOWN, error=f"{path}: cannot read: {exc.strerror or exc}",
                           duration_s=time.monotonic() - start, source=str(path))
    except GpuwardenError as exc:  # kernel_scan.ScanError: a process reading a part of it failed
        from .model import CheckResult, Status

        return CheckResult("analyze", Status.UNKNOWN, error=str(exc), duration_s=time.monotonic() - start,
                           source=str(path))


def _analyze_open(path: Path, f: BinaryIO, start: float) -> CheckResult:
    from .kernel_scan import read_head

    # The vote reads the head's first HEAD_LINES lines: where a shorter head holds them (or the whole file), the rest
    # of the head is read only for the tools' detectors, which a kernel log does not need.
    head, head_text = read_head(f, VOTE_CHARS)
    whole_head = len(head_text) < VOTE_CHARS
    if not whole_head and head_text.count("\n") < HEAD_LINES:
        head, head_text = read_head(f, HEAD_CHARS, have=head)
        whole_head = True
    votes = format_votes(head_text)
    if not _kernel_lines_lead(votes):
        from gpuwarden.checks import ALL

        if not whole_head:
            head, head_text = read_head(f, HEAD_CHARS, have=head)

        for spec in ALL:
            for analyzer in spec.analyzers:
                if analyzer.detect(head_text):
                    return _tool_output(path, f, head, spec.name, analyzer.fmt, analyzer.analyze, start)
    return _kernel_log(path, f, head, format_of_votes(votes), start)


def _kernel_log(path: Path, f: BinaryIO, head: bytes, fmt: str, start: float) -> CheckResult:
    """Every kernel-log check's decision over the file: XIDs and NVSwitch SXids, as preflight and the daemon judge
    them (each check's findings under its own name)."""
    from .kernel_scan import scan

    result = scan(f, str(path), fmt == "kmsg", _kernel_consumers, first=head, interest=KERNEL_INTEREST)
    from .model import CheckResult, Status, fold_status

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
    from .model import CheckResult, Status, fold_status

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


def analyze(paths: Iterable[Path]) -> Report:
    paths = list(paths)
    results = tuple(analyze_file(p) for p in paths)
    from .model import Report

    return Report(node="-", results=results, source=", ".join(str(p) for p in paths), tool="analyze")
