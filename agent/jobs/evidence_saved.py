"""A node's window document from what was saved of it: a copy of the daemon's store (checked whole, read only) or
a recording (`gpuwarden record`), judged by the daemon's checks at the time it was recorded (`gpuwarden explain
--evidence DIR`, `read_dirs`). The document itself is agent/jobs/evidence_window.py's; reading it into a NodeEvidence,
agent/jobs/node_evidence.py's."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Sequence

from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core.errors import GpuwardenError, NotApplicable, SourceError
from gpuwarden.agent.core.model import Status, fold_status
from gpuwarden.agent.core.passive import KernelBatch, event_clock
from gpuwarden.agent.jobs.evidence_window import (
    DEFAULT_LIMIT,
    READ_BUSY_S,
    EvidenceError,
    Snapshot,
    document,
    parse_time,
    read_store,
)
from gpuwarden.agent.jobs.node_evidence import MAX_EVIDENCE_PATHS, DocumentError, NodeEvidence, from_document
from gpuwarden.agent.node.host import Node, NodeInfo
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.store_errors import StoreError
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, PREFLIGHT_NAMES

STORE_NAME = "state.db"  # the daemon's store in its state folder (agent/cli/run.py)
RECORDING_MARK = "node.toml"  # what every recording (`gpuwarden record`) holds (agent/node/record.py)
# The daemon's checks that preflight judges in one look (agent/core/passive.py one_look) and that a recording can be
# judged by; `jobs` reads the host's own state folder, never the recording's, so it is left out.
_RECORDING_PASSIVE_SKIP = {"jobs"}


def window_from_path(path: Path, since: float, until: float, *, limit: int = DEFAULT_LIMIT,
                     now: float | None = None) -> dict[str, Any]:
    """The window document of a saved store: a store file, a folder holding one (a copy of the daemon's state
    folder, or a recording with the node's state.db beside it), or a recording (`gpuwarden record`: its kernel log
    and its hardware judged as the daemon would at the time it was recorded). Read only: the store is opened with
    `mode=ro` and checked whole first. Raises EvidenceError / StoreError / SourceError naming the path."""
    path = Path(path)
    if path.is_dir():
        if (path / STORE_NAME).is_file():
            return _store_window(path / STORE_NAME, since, until, limit, now, _recording_name(path))
        if (path / RECORDING_MARK).is_file():
            return document(read_recording(path), since, until, limit=limit, now=now)
        raise EvidenceError(f"{path}: neither a gpuwarden store ({STORE_NAME}) nor a recording ({RECORDING_MARK})")
    if path.is_file():
        return _store_window(path, since, until, limit, now, _recording_name(path.parent))
    raise EvidenceError(f"{path}: no such file or folder")


def is_evidence(path: Path) -> bool:
    """Whether `path` is one node's evidence (a store file, a folder with a store, a recording), as opposed to a
    folder of several."""
    path = Path(path)
    if path.is_dir():
        return (path / STORE_NAME).is_file() or (path / RECORDING_MARK).is_file()
    return path.is_file()


def _recording_name(folder: Path) -> str | None:
    """The hostname a recording's node.toml names, where the store sits in a recording (else None)."""
    if not (folder / RECORDING_MARK).is_file():
        return None
    try:
        return NodeInfo.from_toml(folder / RECORDING_MARK).hostname or None
    except (GpuwardenError, OSError, ValueError):
        return None


def _store_window(db: Path, since: float, until: float, limit: int, now: float | None,
                  node: str | None) -> dict[str, Any]:
    _check_whole(db)
    store = Store(db, readonly=True, busy_timeout_s=READ_BUSY_S)
    try:
        snap = read_store(store, None)
    finally:
        store.close()
    if node and not snap.node:
        snap = Snapshot(node, snap.record, snap.checks, snap.transitions, snap.intents, snap.watched_until,
                        snap.complete)
    return document(snap, since, until, limit=limit, now=now)


def _check_whole(db: Path) -> None:
    """SQLite's quick_check over a saved store, read only: a truncated or overwritten file reads as what it is, not
    as a node with fewer findings. (The daemon's own store is checked when the daemon opens it.)"""
    try:
        with db.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise StoreError(f"{db}: cannot read: {exc.strerror or exc}") from None
    if head != b"SQLite format 3\0":
        raise StoreError(f"{db}: not a gpuwarden store (not an SQLite database)")
    try:
        conn = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True, timeout=READ_BUSY_S)
    except sqlite3.Error as exc:
        raise StoreError(f"{db}: cannot open: {exc}") from None
    try:
        (result,) = conn.execute("PRAGMA quick_check").fetchone()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        raise StoreError(f"{db}: unreadable: {exc}") from None
    finally:
        conn.close()
    if result != "ok":
        raise StoreError(f"{db}: damaged: {str(result)[:200]}")
    missing = {"node", "checks", "transitions", "intents", "meta"} - tables
    if missing:
        raise StoreError(f"{db}: not a gpuwarden store (no table {', '.join(sorted(missing))})")


def read_recording(root: Path) -> Snapshot:
    """A recording judged at the time it was recorded: its kernel log by the daemon's kernel-log checks (each
    record at the time it was logged, the newest standing for the recording's time, as a recorded node has no
    uptime), and its NVML and sysfs by the daemon's checks that preflight judges in one look. Nothing of a store
    (no node state, transitions or intents): a recording has none. A check that cannot look is listed UNKNOWN with
    the reason."""
    root = Path(root)
    try:
        node = Node.recorded_at(root)
    except (GpuwardenError, OSError) as exc:
        raise SourceError(f"{root}: not a readable recording: {exc}") from None
    at = _recorded_time(node.info.recorded_at, root)
    specs = [*KERNEL_CONSUMERS, *(s for s in PASSIVE if s.name in PREFLIGHT_NAMES
                                  and s.name not in _RECORDING_PASSIVE_SKIP)]
    cfg = config_mod.defaults(specs)
    checks: list[CheckRecord] = []
    try:
        records = node.kmsg.records()
        log_error = None
    except GpuwardenError as exc:
        records, log_error = [], str(exc)
    checks.append(CheckRecord("kmsg", {}, Status.UNKNOWN if log_error else Status.OK, log_error, (), at))
    try:
        gpus = list(node.gpus())
    except GpuwardenError:
        gpus = []  # XIDs still count, named by the PCI address the driver printed
    batch = KernelBatch(records, gpus, node.kmsg.boot_id, event_time=event_clock(at, node.uptime_usec(), records))
    for consumer in KERNEL_CONSUMERS:
        if log_error:
            checks.append(CheckRecord(consumer.name, {}, Status.UNKNOWN, f"kernel log: {log_error}", (), at))
            continue
        checks.append(_judged(consumer.name, lambda c=consumer: c.judge({}, batch, cfg.for_check(c.name), at),
                              at, fold_status))
    for spec in specs[len(KERNEL_CONSUMERS):]:
        def look(s: Any = spec) -> Any:
            table = cfg.for_check(s.name)
            return s.judge({}, s.sample(node, table, {}), table, at)

        try:
            checks.append(_judged(spec.name, look, at, fold_status))
        except NotApplicable:
            continue
    return Snapshot(node.info.hostname, None, tuple(checks), (), (), at)


def _judged(name: str, judge: Any, at: float, fold: Any) -> CheckRecord:
    """One check's record from its judgement at `at`; UNKNOWN with the reason when it could not look (NotApplicable
    goes up: the check does not apply to the node, and is left out)."""
    try:
        j = judge()
    except NotApplicable:
        raise
    except GpuwardenError as exc:
        return CheckRecord(name, {}, Status.UNKNOWN, str(exc), (), at)
    except Exception as exc:  # noqa: BLE001 - a check's defect costs that check, named, never the document
        return CheckRecord(name, {}, Status.UNKNOWN, f"internal error: {type(exc).__name__}: {exc}", (), at)
    return CheckRecord(name, dict(j.state), fold(j.findings), None, tuple(j.findings), at)


def _recorded_time(text: str | None, root: Path) -> float:
    """When the recording was made (node.toml's recorded_at), else its kernel log's modification time."""
    if text:
        try:
            return parse_time(text)
        except ValueError:
            pass
    try:
        return os.stat(root / "kmsg").st_mtime
    except OSError:
        raise SourceError(f"{root / RECORDING_MARK}: no recorded_at, and no kmsg to date the recording by") from None


# -- `--evidence`: the paths given ------------------------------------------------------------------------------
def read_dirs(paths: Sequence[Path], since: float, until: float) -> list[NodeEvidence]:
    """`--evidence`: each path is one node's (a store file, a folder holding a store, a recording) or a folder of
    several, one node each (its entries that are one, in name order). What cannot be read is a NodeEvidence with
    reachable False and the reason naming the path."""
    out: list[NodeEvidence] = []
    for path in map(Path, paths):
        if path.is_dir() and not is_evidence(path):
            try:
                entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
            except OSError as exc:
                out.append(NodeEvidence.unreachable(path.name, str(path), f"{path}: cannot list: "
                                                    f"{exc.strerror or exc}"))
                continue
            found = [p for p in entries if p.is_dir() and is_evidence(p)
                     or p.is_file() and p.name.endswith(".db")]
            if not found:
                out.append(NodeEvidence.unreachable(path.name, str(path), f"{path}: no gpuwarden store or "
                                                    "recording in it"))
            for p in found[:MAX_EVIDENCE_PATHS]:
                out.append(_read_one(p, since, until))
            if len(found) > MAX_EVIDENCE_PATHS:
                out.append(NodeEvidence.unreachable(path.name, str(path), f"{path}: {len(found)} nodes; read the "
                                                    f"first {MAX_EVIDENCE_PATHS}"))
            continue
        out.append(_read_one(path, since, until))
    return out


def _read_one(path: Path, since: float, until: float) -> NodeEvidence:
    name = path.stem if path.is_file() else path.name
    try:
        doc = window_from_path(path, since, until)
    except (GpuwardenError, OSError) as exc:
        text = str(exc)
        return NodeEvidence.unreachable(name, str(path), text if str(path) in text else f"{path}: {text}")
    try:
        return from_document(doc, str(path), host=doc.get("node") or name)
    except DocumentError as exc:
        return NodeEvidence.unreachable(name, str(path), f"{path}: {exc}")
