"""Human output of a Report: one row per check and per finding, with the recommended action."""
from __future__ import annotations

import math
import sys
import textwrap
import threading
import time
from datetime import datetime, timezone
from typing import TextIO

from gpuwarden.agent.core.model import CheckResult, Report, Status

_MARK = {Status.OK: "OK", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.UNKNOWN: "UNKNOWN", Status.SKIPPED: "SKIP"}
_VERDICT = {0: "PASS", 1: "FAULT: action needed", 2: "UNDECIDED: could not judge everything"}


_LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z: the last second ISO 8601 writes with four year digits


def iso_utc(t: float | None) -> str | None:
    """An epoch time as ISO 8601 in UTC to the second (2026-11-30T18:43:36Z); None for no time, a time before
    1970 or after 9999 (a store written by something else), or a number that is not finite."""
    if t is None or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= _LAST_SECOND:
        return None
    return datetime.fromtimestamp(int(t), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def age(seconds: float) -> str:
    """A duration as an operator reads it: 12s, 3m12s, 2h05m, 3d04h (the two largest units)."""
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // sub_size:02d}{sub}"
    return f"{s}s"


def seconds_text(value: object) -> str:
    """A duration for a person: three figures ("30.1 s", not the float's 30.064771072000003), "never (infinite)",
    or "not known" where there is no number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "not known"
    return "never (infinite)" if math.isinf(value) else f"{value:.3g} s"


def when(t: float | None, now: float) -> str:
    """`2026-11-30T18:43:36Z (3m12s ago)`; a time ahead of `now` (a clock stepped back) says so, never a negative
    age; "-" where there is no readable time."""
    stamp = iso_utc(t)
    if stamp is None or t is None:
        return "-" if t is None else f"{t!r} (not a time)"
    ago = now - t
    return f"{stamp} ({age(ago)} ago)" if ago >= 0 else f"{stamp} ({age(-ago)} ahead of this clock)"


def table(report: Report) -> str:
    """One line per check (or per finding), then the finding's message indented under it, wrapped."""
    import shutil  # at use: with the archives it loads, 2 ms of every start, and --json draws no table

    width = max(80, shutil.get_terminal_size((120, 24)).columns)
    lines = [f"gpuwarden {report.tool}: {report.node}  ({report.source})", ""]
    cw = max([len("CHECK"), *(len(r.check) for r in report.results)])
    lines.append(f"{'CHECK':<{cw}} {'STATUS':<8} {'ACTION':<11} {'CODE':<30} ENTITY")
    for r in report.results:
        lines.extend(_rows(r, width, cw))
    lines.append("")
    lines.append(f"verdict: {_VERDICT[report.exit_code]} (exit {report.exit_code})")
    return "\n".join(lines) + "\n"


def _wrapped(text: str, width: int, indent: int) -> list[str]:
    pad = " " * indent
    return textwrap.wrap(text, width=width, initial_indent=pad, subsequent_indent=pad) or []


def _rows(r: CheckResult, width: int, cw: int) -> list[str]:
    rows = []
    pad = cw + 1
    if r.source:
        rows.append(f"{r.check:<{cw}} {'':<8} {'':<11} {'':<30} file {r.source}")
    if not r.findings:
        rows.append(f"{r.check:<{cw}} {_MARK[r.status]:<8} {'-':<11} {'-':<30} -")
        rows += _wrapped(r.error or f"ran in {r.duration_s:.2f}s, nothing found", width, pad)
    for f in r.findings:
        entity = f.entity.label()
        rows.append(f"{r.check:<{cw}} {_MARK[f.status]:<8} {f.action.name:<11} {f.code:<30} {entity}")
        detail = f.message[len(entity) + 2:] if f.message.startswith(entity + ": ") else f.message
        rows += _wrapped(detail, width, pad)
    if r.findings and r.error:  # stopped part-way: say why after what it found
        rows += _wrapped(f"stopped: {r.error}", width, pad)
    for note in r.notes:
        rows += _wrapped(f"note: {note}", width, pad)
    return rows


class Progress:
    """A one-line "running: …" display on a TTY for checks that take more than a moment."""

    def __init__(self, stream: TextIO = sys.stderr, delay_s: float = 0.5):
        self.stream, self.delay_s = stream, delay_s
        self.enabled = stream.isatty()
        self._running: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=self._tick, name="progress", daemon=True).start()

    def _tick(self) -> None:
        # Redraw so a long check's elapsed time moves even when no other check finishes.
        while not self._stop.wait(self.delay_s):
            with self._lock:
                if self._running:
                    self._draw()

    def __call__(self, name: str, phase: str, result: CheckResult | None) -> None:
        if not self.enabled:
            return
        with self._lock:
            if phase == "start":
                self._running[name] = time.monotonic()
            else:
                self._running.pop(name, None)
            self._draw()

    def _draw(self) -> None:
        now = time.monotonic()
        slow = [f"{n} {now - t:.0f}s" for n, t in self._running.items() if now - t >= self.delay_s]
        self.stream.write("\r\033[K" + (f"running: {', '.join(slow)}" if slow else ""))
        self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()
