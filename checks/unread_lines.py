"""Kernel lines a kernel-log check could not read: a line that mentions an XID or SXid in a form not read here is
kept (a bounded sample, with file:line) and reported UNKNOWN for as long as an incident would stand, so an unknown
driver format surfaces instead of vanishing. The state is a JSON-ready dict a check keeps beside its incidents."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from gpuwarden.agent.core.model import Action, Entity, Finding, Status

MAX_KEPT = 10  # lines kept as evidence; the count goes on


def note(unread: dict[str, Any], records: Iterable[Any], at_of: Callable[[Any], float]) -> None:
    """Adds `records` to `unread` (a copy the judge owns), each at the time it was logged."""
    for r in records:
        unread["count"] = unread.get("count", 0) + 1
        unread["last_at"] = at_of(r)
        lines = unread.setdefault("lines", [])
        if len(lines) < MAX_KEPT:
            lines.append({"source": r.source, "line": r.line, "seq": r.seq, "message": r.message[:300]})


def nothing_held(state: Mapping[str, Any]) -> bool:
    """A kernel-log check's state with no incident and no unread line: nothing holds, so nothing ends by time (its
    KernelConsumer.quiet)."""
    return not state.get("incidents") and not state.get("unread")


def standing(unread: Mapping[str, Any], now: float, hold_s: float, hold: bool = True) -> bool:
    """Whether the unread lines are still reported: for hold_s after the last one (always without `hold`)."""
    return bool(unread) and (not hold or now - unread["last_at"] <= hold_s)


def ends_at(unread: Mapping[str, Any], hold_s: float, hold: bool = True) -> float | None:
    """When standing unread lines stop being reported (None: never by time alone)."""
    return unread["last_at"] + hold_s if unread and hold else None


def finding(check: str, code: str, what: str, unread: Mapping[str, Any]) -> Finding:
    first = unread["lines"][0]
    return Finding(check, code, Entity("node", "kernel-log"), Status.UNKNOWN,
                   f"{unread['count']} kernel line(s) mention an {what} in a form gpuwarden cannot read, first at "
                   f"{first['source']}:{first['line']}: \"{first['message'][:160]}\"; the {what} they report is not "
                   "judged", Action.NONE, {"count": unread["count"], "lines": unread["lines"]})
