"""A passive check's record as the daemon keeps it (CheckRecord: its state, status, error and findings) and how the
store (agent/state/store.py) writes it and reads it back: in parts, each written only when it changed.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import field
from itertools import compress
from operator import is_not
from typing import Any

from gpuwarden.agent.core.model import Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.state.store_errors import as_object, decode

# A check's state and findings are written in parts (table check_parts, agent/state/store_schema.py), each part only
# when it changed, so a commit costs what changed, not what the check holds (the xid check's incidents, one per GPU and
# XID, each written when it moved): "state:<key>" / <entry> is one entry of a top-level state value that maps names to
# objects; "finding" / <index> is one finding. The checks row keeps the rest of the state and the status. Rows an
# older version wrote (the whole state and findings in the checks row, no parts) read the same.
_FINDING = "finding"
_STATE = "state:"


@dataclass
class Group:
    """What the database holds of one split state value: each entry (the object last written or read) and its
    place (ord), and the place a new entry takes."""

    values: dict[str, Any]
    ords: dict[str, int]
    next: int


@dataclass
class Held:
    """What the database holds of one check's parts: its split state values by part, and its findings."""

    groups: dict[str, Group]
    findings: tuple[Finding, ...]


@dataclass
class CheckRecord:
    name: str
    state: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.UNKNOWN
    error: str | None = "not run yet"
    findings: tuple[Finding, ...] = ()
    updated: float = 0.0
    duration_s: float = 0.0


def write_check(db: sqlite3.Connection, c: CheckRecord, old: Held | None, complete: bool) -> Held:
    """Writes one check's row and those of its parts that differ from what the database holds (inside the
    caller's transaction); returns what the database then holds of its parts. The work is what changed: the
    entries and findings that are the objects last written are passed over at C speed, never visited one by one
    in Python (a node holding many incidents writes only the one an XID moved)."""
    name = c.name
    if old is None:
        if not complete:  # not known: every part written, whatever an earlier run left removed
            db.execute("DELETE FROM check_parts WHERE name = ?", (name,))
        old = Held({}, ())
    # Changed in place: a commit that fails drops the whole of it (commit), so nothing half-updated is kept.
    held = old
    rest: dict[str, Any] = {}
    rows: list[tuple] = []
    gone: list[tuple] = []
    groups: dict[str, Group] = {}
    for key, value in c.state.items():
        part = _STATE + key
        group = held.groups.get(part)
        if not (isinstance(value, dict) and value):
            rest[key] = value
            continue
        before = group.values if group is not None else {}
        changed = list(compress(value.keys(), map(is_not, value.values(), map(before.get, value.keys()))))
        # A value that maps names to objects is split into entries; the entries last written are objects still.
        if not all(isinstance(value[sub], dict) for sub in (changed if group is not None else value)):
            rest[key] = value
            continue
        if group is None:
            group = Group({}, {}, 0)
        values, ords = group.values, group.ords
        for sub in changed:
            entry = value[sub]
            was = values.get(sub)
            values[sub] = entry  # the object now held: the next commit's identity test
            if was is not None and was == entry:
                continue
            order = ords.get(sub)
            if order is None:  # a new entry goes last; an entry keeps its place (read back in the order they came)
                order = ords[sub] = group.next
                group.next += 1
            rows.append((name, part, str(sub), order, json.dumps(entry)))
        if len(values) > len(value):
            live = {str(sub) for sub in value}  # a key read back as text may be given as a number
            for sub in values.keys() - value.keys():
                del values[sub], ords[sub]
                if str(sub) not in live:
                    gone.append((name, part, str(sub)))
        groups[part] = group
    for part, group in held.groups.items():
        if part not in groups:
            gone.extend((name, part, str(sub)) for sub in group.values)
    findings, before_f = c.findings, held.findings
    common = min(len(findings), len(before_f))
    for i in compress(range(common), map(is_not, findings, before_f)):
        if findings[i] != before_f[i]:
            rows.append((name, _FINDING, str(i), i, json.dumps(findings[i].to_dict())))
    rows.extend((name, _FINDING, str(i), i, json.dumps(findings[i].to_dict()))
                for i in range(common, len(findings)))
    gone.extend((name, _FINDING, str(i)) for i in range(common, len(before_f)))
    if rows:
        db.executemany("INSERT OR REPLACE INTO check_parts VALUES (?, ?, ?, ?, ?)", rows)
    if gone:
        db.executemany("DELETE FROM check_parts WHERE name = ? AND part = ? AND sub = ?", gone)
    db.execute("INSERT OR REPLACE INTO checks VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (name, json.dumps(rest), c.status.value, c.error, "[]", c.updated, c.duration_s))
    held.groups, held.findings = groups, tuple(findings)
    return held


def read_check(row: tuple, parts: list[tuple] = ()) -> tuple[CheckRecord, Held]:
    """A check's record from its row and its parts (ordered by part, then ord), and what the parts hold."""
    name, state, status, error, findings, updated, duration = row

    def build() -> tuple[CheckRecord, Held]:
        whole = as_object(json.loads(state))
        listed = [Finding.from_dict(f) for f in json.loads(findings)]
        # Findings an older version kept in the row are not parts: the first write puts each in a part of its own.
        from_row = len(listed)
        groups: dict[str, Group] = {}
        for _name, part, sub, order, value in parts:
            if part == _FINDING:
                listed.append(Finding.from_dict(json.loads(value)))
            elif part.startswith(_STATE):
                item = as_object(json.loads(value))
                entries = whole.setdefault(part[len(_STATE):], {})
                as_object(entries)[sub] = item
                group = groups.get(part)
                if group is None:
                    group = groups[part] = Group({}, {}, 0)
                group.values[sub] = item
                group.ords[sub] = int(order)
                group.next = max(group.next, int(order) + 1)
            else:
                raise ValueError(f"unknown part {part!r}")
        record = CheckRecord(str(name), whole, Status(status), error, tuple(listed), float(updated), float(duration))
        return record, Held(groups, (None,) * from_row + tuple(listed[from_row:]))

    return decode(f"check {name!r}", build)
