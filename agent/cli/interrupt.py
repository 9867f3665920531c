"""The rule of the commands that start tools (preflight, record, slurm): SIGINT/SIGTERM end every tool a command
started before it exits. `Interrupted` is raised for them in the main thread; cli.main turns it into exit status
130 / 143."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached a command that runs tools: raised in the main thread, so the runner ends every tool
    it started on the way out (BaseException: no `except Exception` on the way may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def tools_end_on_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise Interrupted; a second signal while the tools are being ended is ignored, so the ending
    (bounded: a grace, then SIGKILL) is not cut short and no tool outlives the command (a Slurm Prolog's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
