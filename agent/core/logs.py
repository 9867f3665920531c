"""Structured logging: `log.info("event", key=value)` writes one JSON object per line (journald, files) or, on a
TTY, one readable line; levels below the configured one cost a comparison and nothing else.

Each JSON line holds the keyword arguments, then `event`, `level` and `timestamp` (ISO 8601, UTC, with a Z), in
that order. Values that JSON cannot hold are written as their repr. Written to sys.stderr as it is when the line
is written (a test harness that swaps it, a daemon that re-opens its log), one whole line per write, flushed."""
from __future__ import annotations

import json
import sys
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterator

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_PAD_EVENT = 30  # the console line's event column, so that the keys of successive lines start together


class _Config:
    __slots__ = ("threshold", "use_json", "stream", "sink")

    def __init__(self) -> None:
        self.threshold = LEVELS["info"]
        self.use_json: bool | None = None  # None: decided per line from whether the stream is a TTY
        self.stream: Any = None  # None: sys.stderr as it is at write time
        self.sink: list[dict[str, Any]] | None = None  # capture(): entries kept here instead of written


_config = _Config()
_lock = threading.Lock()  # one line at a time: the daemon's threads log concurrently


def setup(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """fmt: auto (console on a TTY, JSON otherwise), json or console; level: debug|info|warning|error (an unknown
    name is info); stream: where lines go (default: sys.stderr as it is at write time)."""
    _config.threshold = LEVELS.get(str(level).lower(), LEVELS["info"])
    _config.use_json = True if fmt == "json" else False if fmt == "console" else None
    _config.stream = stream


class Logger:
    """A named logger. The name is not written (the event says what happened); it keeps `get_logger(NAME)` lines
    telling the reader which part of the agent a module is."""

    __slots__ = ("name",)

    def __init__(self, name: str = "gpuwarden") -> None:
        self.name = name

    def debug(self, event: str, **kw: Any) -> None:
        if _config.threshold <= 10:
            _emit("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        if _config.threshold <= 20:
            _emit("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        if _config.threshold <= 30:
            _emit("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        if _config.threshold <= 40:
            _emit("error", event, kw)

    def critical(self, event: str, **kw: Any) -> None:
        if _config.threshold <= 50:
            _emit("critical", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        """error, with the exception being handled written under `exception`."""
        kw.setdefault("exc_info", True)
        self.error(event, **kw)


def get_logger(name: str = "gpuwarden") -> Logger:
    return Logger(name)


def _emit(level: str, event: str, kw: dict[str, Any]) -> None:
    if kw.pop("exc_info", None):
        import traceback  # at use: +3 ms (python -X importtime) to every command's start, `--version` included

        kw["exception"] = traceback.format_exc().rstrip("\n")
    entry = {**kw, "event": event, "level": level}
    if _config.sink is not None:
        _config.sink.append(entry)
        return
    entry["timestamp"] = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    stream = _config.stream or sys.stderr
    use_json = _config.use_json
    if use_json is None:
        try:
            use_json = not stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            use_json = True
    line = json.dumps(entry, default=repr) if use_json else _console(entry)
    with _lock:
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: losing a log line must not stop the agent
            pass


def _console(entry: dict[str, Any]) -> str:
    """`2026-01-02T03:04:05.678901Z [warning  ] event text                    key=value other=[1, 2]`; the
    exception, if any, on the lines after."""
    exc = entry.pop("exception", None)
    head = f"{entry.pop('timestamp')} [{entry.pop('level'):<9}] {entry.pop('event'):<{_PAD_EVENT}}"
    keys = " ".join(f"{k}={_console_value(v)}" for k, v in sorted(entry.items()))
    return (head + " " + keys).rstrip() + (f"\n{exc}" if exc else "")


def _console_value(value: Any) -> str:
    """A word as it is; text with spaces (or none) quoted, so that key=value pairs stay apart; anything else repr."""
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    return repr(value)


@contextmanager
def capture() -> Iterator[list[dict[str, Any]]]:
    """The entries logged inside the block (each the keyword arguments with `event` and `level`; no timestamp),
    at every level, instead of written."""
    saved = (_config.sink, _config.threshold)
    _config.sink, _config.threshold = [], 0
    try:
        yield _config.sink
    finally:
        _config.sink, _config.threshold = saved


@contextmanager
def silenced(below: str = "critical") -> Iterator[None]:
    """Nothing below `below` is written inside the block (a simulation that drives the agent many thousand times)."""
    saved = _config.threshold
    _config.threshold = LEVELS[below]
    try:
        yield
    finally:
        _config.threshold = saved


@contextmanager
def preserved() -> Iterator[None]:
    """The logging set up inside the block (a command's main) is undone when it ends."""
    saved = (_config.threshold, _config.use_json, _config.stream)
    try:
        yield
    finally:
        _config.threshold, _config.use_json, _config.stream = saved
