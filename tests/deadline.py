"""A generous deadline for the parsers' linearity tests. A linear parser reads a 1 MiB line in milliseconds; a
backtracking regex on the same line runs for hours. 20 s tells them apart on any machine, loaded or not, without
the test timing anything (the real figures are in bench/README.md)."""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

MIB = 1 << 20


@contextmanager
def deadline(seconds: int = 20) -> Iterator[None]:
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: the parser is not linear in its input")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
