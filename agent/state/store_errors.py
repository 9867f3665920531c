"""What the state store raises (agent/state/store.py), and how it tells a database it cannot read from a write that
failed for now: a write that fails (disk full, database locked) is a StoreError the caller retries; a database or
a value in it that is not what the daemon writes is StoreUnreadable, set aside, never half-trusted.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuwarden.agent.core.errors import GpuwardenError

if TYPE_CHECKING:
    import sqlite3

# SQLite result codes that mean the file's content cannot be trusted (sqlite3.h), as opposed to a write that
# failed for now (SQLITE_FULL, SQLITE_BUSY, SQLITE_IOERR, SQLITE_READONLY, SQLITE_CANTOPEN).
_UNREADABLE = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}


class StoreError(GpuwardenError):
    pass


class StoreUnreadable(StoreError):
    """The database or a value in it is not what the daemon writes: set aside, never half-trusted."""


class StateInUse(StoreError):
    """Another daemon holds the state folder."""


def unreadable(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", None)
    if name:
        return name.startswith(tuple(_UNREADABLE))
    text = str(exc)
    return "not a database" in text or "malformed" in text


def decode(where: str, build: Any) -> Any:
    try:
        return build()
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise StoreUnreadable(f"{where}: {type(exc).__name__}: {exc}") from None


def as_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"want an object, got {type(value).__name__}")
    return value
