"""`gpuwarden analyze FILE…`: the post-mortem tool. Detects what each saved file is (today: a kernel log
in any of dmesg / journalctl / syslog / raw kmsg forms) and reports the findings the live check would."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

from .errors import ParseError
from .kernel_log import detect_format
from .model import CheckResult, Finding, Report, Status, fold_status

# (format name, analyzer): analyzer(text, source) -> (check name, findings, parse errors)
Analyzer = Callable[[str, str], "tuple[str, list[Finding], list[ParseError]]"]


def _kernel_log(text: str, source: str) -> tuple[str, list[Finding], list[ParseError]]:
    from gpuwarden.checks.xid import analyze_text  # checks import agent: import at use, not at load

    findings, errors = analyze_text(text, source)
    return "xid", findings, errors


def detect(text: str) -> tuple[str, Analyzer]:
    """Which analyzer reads this text. Kernel logs are the fallback: any text may hold NVRM lines."""
    return f"kernel-log/{detect_format(text)}", _kernel_log


def analyze_file(path: Path) -> CheckResult:
    start = time.monotonic()
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError as exc:
        return CheckResult("analyze", Status.UNKNOWN, error=f"{path}: cannot read: {exc.strerror or exc}",
                           source=str(path))
    fmt, analyzer = detect(text)
    check, findings, errors = analyzer(text, str(path))
    notes = tuple(str(e) for e in errors)
    status = fold_status(findings)
    error = None
    if not text.strip():
        status, error = Status.UNKNOWN, f"{path}: empty file"
    return CheckResult(check, status, tuple(findings), error, time.monotonic() - start,
                       source=f"{path} ({fmt})", notes=notes)


def analyze(paths: Iterable[Path]) -> Report:
    paths = list(paths)
    return Report(node="-", results=tuple(analyze_file(p) for p in paths),
                  source=", ".join(str(p) for p in paths), tool="analyze")
