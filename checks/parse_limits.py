"""Bounds every tool-output parser holds to: how much text one output may be, and what a number in it may be.

Tool output is hostile input (a damaged capture, a file handed to `analyze`): a parser reads it in time linear in
its length, and every number it takes is written in ASCII digits, short enough for `int`, and finite."""
from __future__ import annotations

import math

from gpuwarden.agent.core.errors import ParseError

MAX_TEXT = 64 << 20  # characters of one tool output: far past anything these tools print on one node
MAX_DIGITS = 18  # an integer field: enough for any byte count or id these tools print, always under 2**63
# Characters of a line that the patterns telling messages apart (errors, warnings, banners) look at: every message
# these tools print is far shorter, and a scan of a 10 MiB line by a dozen alternatives costs seconds.
MAX_MESSAGE = 4096
MAX_NUMBER_CHARS = 40  # a decimal number with fraction and exponent, as printed by the tools ("%.2f", "%g")


def check_size(text: str, source: str, what: str) -> None:
    if len(text) > MAX_TEXT:
        raise ParseError(f"{what} is {len(text) / (1 << 20):.0f} MiB, more than the {MAX_TEXT >> 20} MiB any run "
                         "prints: not read", source)


def is_decimal(token: str) -> bool:
    """ASCII digits only: str.isdigit also takes "²" and "١٢٣", which int() refuses or reads as another number."""
    return token.isascii() and token.isdecimal()


def bounded_int(token: str, what: str, source: str, line: int | None, max_digits: int = MAX_DIGITS) -> int:
    """An unsigned decimal integer of at most `max_digits` digits, else ParseError naming where."""
    if not is_decimal(token):
        raise ParseError(f"{what}: {token[:20]!r} is not a decimal number", source, line)
    if len(token) > max_digits:
        raise ParseError(f"{what}: a number of {len(token):,} digits (at most {max_digits})", source, line)
    return int(token)


def finite_float(token: str, what: str, source: str, line: int | None) -> float:
    """A finite decimal number (the caller's regex has checked its shape), else ParseError naming where."""
    if len(token) > MAX_NUMBER_CHARS:
        raise ParseError(f"{what}: a number of {len(token):,} characters (at most {MAX_NUMBER_CHARS})", source, line)
    value = float(token)
    if not math.isfinite(value):
        raise ParseError(f"{what}: {token!r} is not a finite number", source, line)
    return value


def text_lines(text: str) -> list[str]:
    """The lines of a tool output as an editor numbers them: split at "\n" only (str.splitlines also breaks at
    "\r", "\x0c", "\u2028", ..., so the line numbers in messages would point past the end of the file). A
    trailing "\r" is kept; the parsers strip their lines."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines
