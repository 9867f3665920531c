"""The floods of a job log's reader (agent/jobs/joblog.py): which flood an event belongs to, what the reader keeps
of each, and which digit runs of a line its floods' keys may come from (for the lines counted in C,
agent/core/_repeats.h)."""
from __future__ import annotations

import re
from typing import Any

_DIGIT_RUNS = re.compile(rb"[0-9]+")


class Flood:
    """The lines of one _key so far: how many, the slot of its last in the events, and that last line."""

    __slots__ = ("seen", "slot", "pending")

    def __init__(self) -> None:
        self.seen = 0
        self.slot = -1
        self.pending: tuple = ()


def key(kind: str, fields: dict[str, Any], ctx: dict[str, Any]) -> tuple:
    """Which flood an event belongs to: its kind from one process, rank, process group and peer."""
    return kind, ctx.get("host"), ctx.get("pid"), ctx.get("rank"), fields.get("pg"), fields.get("peer")


def significant(raw: bytes | bytearray, events: list) -> int:
    """Bit k for each run of digits of the line that one of its floods' keys may have been read from (agent/core/
    _repeats.h): a run whose number is one of the key's numbers (a rank, a pid, a process group) or one of the runs
    of its names (a host, a peer's address). More runs than the key's only split a flood between entries."""
    wanted: set[int] = set()
    for _, kind, fields, ctx in events:
        for value in key(kind, fields, ctx)[1:]:
            if isinstance(value, int):
                wanted.add(value)
            elif isinstance(value, str):
                wanted.update(int(run) for run in _DIGIT_RUNS.findall(value.encode()))
    bits = 0
    for k, run in enumerate(_DIGIT_RUNS.findall(bytes(raw))[:64]):
        if int(run) in wanted:
            bits |= 1 << k
    return bits
