"""structlog setup: readable lines on a TTY, one JSON object per line otherwise (journald, files)."""
from __future__ import annotations

import logging
import sys

import structlog


class _StandardError:
    """sys.stderr as it is when a line is written, not as it was at setup: a caller that swaps it (a test harness
    capturing output, a daemon re-opening its log) must not leave the logger writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def setup(fmt: str = "auto", level: str = "info", stream=None) -> None:
    stream = stream or _StandardError()
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
