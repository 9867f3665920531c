"""`gpuwarden analyze FILE…`: the post-mortem tool. Detects what each saved file is (a kernel log in any of dmesg /
journalctl / syslog / raw kmsg forms, or a tool's output) and reports the findings the checks' own decisions give."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

from .errors import GpuwardenError, ParseError
from .kernel_log import detect_format, parse_log_text
from .model import CheckResult, Finding, Report, Status, fold_status

# (format name, analyzer): analyzer(text, source) -> (check name, findings, parse errors)
Analyzer = Callable[[str, str], "tuple[str, list[Finding], list[ParseError]]"]


def _kernel_log(text: str, source: str) -> tuple[str, list[Finding], list[ParseError]]:
    """Every kernel-log check's decision over the file: XIDs and NVSwitch SXids, as preflight and the daemon judge
    them (one parse of the text, each check's findings under its own name)."""
    from gpuwarden.checks import nvswitch_sxid, xid  # checks import agent: import at use, not at load

    records, errors = parse_log_text(text, source)
    findings = xid.judge_records(records) + nvswitch_sxid.judge_records(records)
    return "kernel_log", findings, errors


def detect(text: str) -> tuple[str, Analyzer]:
    """Which analyzer reads this text: the first check analyzer whose format matches, in check order; kernel
    logs are the fallback (any text may hold NVRM lines)."""
    from gpuwarden.checks import ALL

    for spec in ALL:
        for analyzer in spec.analyzers:
            if analyzer.detect(text):
                return analyzer.fmt, _wrap(spec.name, analyzer.analyze)
    return f"kernel-log/{detect_format(text)}", _kernel_log


def _wrap(check: str, fn: Callable[[str, str], "tuple[list[Finding], list[ParseError]]"]) -> Analyzer:
    def run(text: str, source: str) -> tuple[str, list[Finding], list[ParseError]]:
        findings, errors = fn(text, source)
        return check, findings, errors

    return run


def analyze_file(path: Path) -> CheckResult:
    start = time.monotonic()
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError as exc:
        return CheckResult("analyze", Status.UNKNOWN, error=f"{path}: cannot read: {exc.strerror or exc}",
                           source=str(path))
    fmt, analyzer = detect(text)
    try:
        check, findings, errors = analyzer(text, str(path))
    except GpuwardenError as exc:  # the whole file is unreadable as its format (garbage, truncated JSON)
        return CheckResult("analyze", Status.UNKNOWN, error=str(exc), duration_s=time.monotonic() - start,
                           source=f"{path} ({fmt})")
    notes = tuple(str(e) for e in errors)
    status = fold_status(findings)
    error = None
    if not text.strip():
        status, error = Status.UNKNOWN, f"{path}: empty file"
    elif fmt == "kernel-log/plain" and not findings:
        # Nothing in it looked like any format gpuwarden reads: finding no fault there means nothing.
        status, error = Status.UNKNOWN, (f"{path}: not a format gpuwarden reads (kernel log, nccl-tests, perftest, "
                                         "dcgmi diag JSON or text)")
    return CheckResult(check, status, tuple(findings), error, time.monotonic() - start,
                       source=f"{path} ({fmt})", notes=notes)


def analyze(paths: Iterable[Path]) -> Report:
    paths = list(paths)
    return Report(node="-", results=tuple(analyze_file(p) for p in paths),
                  source=", ".join(str(p) for p in paths), tool="analyze")
