"""The values of command-line flags, as the plan commands read them: every number is hostile until it is
finite, bounded and named. A value that is not one is a ConfigError naming the flag and quoting the value cut short;
no int() or float() is ever given a thousand-digit string.
"""
from __future__ import annotations

import math

from gpuwarden.agent.core.errors import ConfigError

# Longer than any number a person types; keeps int()/float() away from thousand-digit strings.
MAX_NUMBER_CHARS = 32
MAX_LIST_CHARS = 4_096


def shown(text: object) -> str:
    """A flag's value as an error message quotes it: cut short, so a hostile value is not echoed back whole."""
    s = str(text)
    return repr(s if len(s) <= 40 else s[:40] + "…")


def parse_int(text: str, flag: str, lo: int, hi: int) -> int:
    """A whole number in [lo, hi]; anything else is a ConfigError naming the flag."""
    s = str(text).strip()
    digits = s[1:] if s[:1] in ("+", "-") else s
    if not s or len(s) > MAX_NUMBER_CHARS or not s.isascii() or not digits.isdigit():
        raise ConfigError(f"{flag} {shown(text)}: expected a whole number in [{lo:,}, {hi:,}]")
    value = int(s)
    if not lo <= value <= hi:
        raise ConfigError(f"{flag} {value:,}: expected a whole number in [{lo:,}, {hi:,}]")
    return value


def parse_float(text: str, flag: str, lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False,
                unit: str = "") -> float:
    """A finite number in [lo, hi] (or open at either end); a trailing '%' is allowed where the unit is '%'."""
    s = str(text).strip()
    if unit == "%" and s.endswith("%"):
        s = s[:-1].strip()
    left, right = ("(" if lo_open else "["), (")" if hi_open else "]")
    want = f"a finite number in {left}{lo:g}, {hi:g}{right}{unit}"
    if not s or len(s) > MAX_NUMBER_CHARS or not s.isascii():
        raise ConfigError(f"{flag} {shown(text)}: expected {want}")
    try:
        value = float(s)
    except ValueError:
        raise ConfigError(f"{flag} {shown(text)}: expected {want}") from None
    if not math.isfinite(value) or value < lo or value > hi or (hi_open and value == hi) or (lo_open and value == lo):
        raise ConfigError(f"{flag} {shown(text)}: expected {want}")
    return value


def split_list(text: str, flag: str) -> list[str]:
    """The comma-separated values of a flag, each non-empty; the whole bounded in length."""
    s = str(text)
    if len(s) > MAX_LIST_CHARS:
        raise ConfigError(f"{flag}: {len(s):,} characters; at most {MAX_LIST_CHARS:,}")
    items = [i.strip() for i in s.split(",")]
    if not items or any(not i for i in items):
        raise ConfigError(f"{flag} {shown(text)}: an empty value in the list")
    return items
