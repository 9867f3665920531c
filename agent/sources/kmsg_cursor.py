"""The kernel-log cursor: the last record read (boot_id, seq), what the daemon persists so a restart neither misses
nor repeats a record, and where a follower resumes at a start (`resume_cursor`)."""
from __future__ import annotations

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.records import dataclass

log = logs.get_logger("gpuwarden.kmsg")


@dataclass(frozen=True)
class Cursor:
    boot_id: str | None
    seq: int


def resume_cursor(saved: object, counted: "tuple[str | None, int] | None", boot_id: str | None) -> Cursor | None:
    """Where the follower of boot `boot_id` resumes at a start: after the records counted (`counted`, the store's
    (boot_id, seq) up to which every record was handed to the consumers, written with their counts), whatever the
    saved cursor (`saved`, meta kmsg_cursor) says: a cursor edited or rolled back would lose or repeat records.
    Only where nothing was counted is the saved cursor used (a store that has no such row). None: the boot's log
    from its start (nothing saved, or another boot's)."""
    cursor = _as_cursor(saved)
    if saved is not None and cursor is None:
        log.warning("kernel-log cursor in the state store is not a cursor; ignored", cursor=repr(saved)[:200])
    if counted is not None:
        known = Cursor(*counted)
        if cursor is not None and cursor != known:
            log.warning("kernel-log cursor disagrees with the records counted; resuming after the records counted "
                        "(a record is counted once, by boot id and seq)", cursor_boot_id=cursor.boot_id,
                        cursor_seq=cursor.seq, counted_boot_id=known.boot_id, counted_seq=known.seq)
        return known if known.boot_id == boot_id else None
    return cursor if cursor is not None and cursor.boot_id == boot_id else None


def _as_cursor(saved: object) -> Cursor | None:
    if not isinstance(saved, dict) or set(saved) != {"boot_id", "seq"}:
        return None
    boot_id, seq = saved["boot_id"], saved["seq"]
    if (boot_id is not None and not isinstance(boot_id, str)) or type(seq) is not int:
        return None
    return Cursor(boot_id, seq)
