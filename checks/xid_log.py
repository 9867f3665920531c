"""What the NVIDIA driver prints about XIDs, read from kernel-log records: the XID lines (on MIG GPUs with the GPU and
compute instance they were attributed to), the "GPU at PCI:... GPU-<uuid>" lines that name a GPU, and the lines that
mention an XID in a form not read here (reported, never dropped).

The driver's formats (NVIDIA open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/rc/kernel_rc.c):
  NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, <message>
  NVRM: Xid (PCI:%04x:%02x:%02x): %d, <message>                        (no process)
  NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u): %d, ...                   (MIG: GPU instance)
  NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u): %d, ...       (MIG: GPU and compute instance)
"""
from __future__ import annotations

import re
from dataclasses import fields, make_dataclass
from typing import Callable, Iterable, Protocol, Sequence

from gpuwarden.agent.core.kernel_log import LogRecord
from gpuwarden.agent.core.log_rows import text_runs
from gpuwarden.agent.core.model import Entity
from gpuwarden.agent.core.records import dataclass

_PCI = r"PCI:([0-9a-fA-F]{1,8}+):([0-9a-fA-F]{2}+):([0-9a-fA-F]{2}+)(?:\.([0-7]))?+"
# Every quantifier is bounded or possessive and the prefix is a literal: a search is linear in the line.
_XID = re.compile(r"NVRM: Xid \(" + _PCI + r"(?: GPU-I:([0-9]{1,4}+))?+(?: GPU-CI:([0-9]{1,4}+))?+\): "
                  r"([0-9]{1,6}+)(?![0-9])")
_PREAMBLE = re.compile(r"NVRM: GPU at " + _PCI + r": (GPU-[0-9a-fA-F-]{8,64}+)")
XID_MARK = "NVRM: Xid"  # a line with this and no readable XID is reported as unreadable, never skipped
MAX_LINE = 4096  # the driver's lines are a few hundred characters; a longer one is kept cut, not read whole


class GpuRef(Protocol):
    index: int | None
    uuid: str | None
    pci: str | None  # canonical BDF, "0000:91:00.0"

    @property
    def entity(self) -> Entity: ...


@dataclass(frozen=True, slots=True)
class XidEvent:
    xid: int
    pci: str  # canonical lower-case BDF with function, "0000:91:00.0"
    pid: str | None
    process: str | None
    detail: str  # the driver's text after pid/name
    record: LogRecord | None = None
    gpu_instance: int | None = None  # MIG: the GPU instance the driver attributed the XID to
    compute_instance: int | None = None


# An XID line's event is built as this mutable twin with the identical slots, then retyped (kernel_log builds its
# LogRecords so): a frozen dataclass's __init__ sets each field through object.__setattr__, ~3x the cost.
_XidEventBuilder = make_dataclass("_XidEventBuilder", [(f.name, f.type) for f in fields(XidEvent)], slots=True)


@dataclass(frozen=True)
class LoggedGpu:
    """A GPU known only from the driver's "GPU at PCI:... GPU-<uuid>" line (NVML lost it or is absent)."""

    uuid: str
    pci: str
    index: int | None = None

    @property
    def entity(self) -> Entity:
        return Entity("gpu", self.uuid, None, self.pci)


def _bdf(domain: str, bus: str, device: str, function: str | None) -> str:
    # NVRM prints domain:bus:device; the function of a GPU is 0.
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function or '0'}"


def _field_value(text: str) -> str | None:
    value = text.strip().strip("'`\"")  # pid='<unknown>', pid='`<unknown>`' (a markdown-mangled copy)
    return None if value in ("", "<unknown>") else value[:64]


# A flood of XIDs repeats the same few driver lines: each distinct line is read once (a pure function of its text).
# Bounded: lines up to _READ_LINE characters, _READ_MAX of them (under 1 MB), forgotten all at once when full.
_READ: dict[str, tuple[int, str, str | None, str | None, str, int | None, int | None] | None] = {}
_READ_MAX = 1024
_READ_LINE = 512


def parse_xid(message: str, record: LogRecord | None = None) -> XidEvent | None:
    """The XID in one kernel message, or None (SXid, "Xid PCI:..." without parentheses, other lines)."""
    key = message[:MAX_LINE]
    read = _READ.get(key, _READ)
    if read is _READ:
        read = _read_xid(key)
        if len(key) <= _READ_LINE:
            if len(_READ) >= _READ_MAX:
                _READ.clear()
            _READ[key] = read
    if read is None:
        return None
    xid, pci, pid, process, detail, gpu_instance, compute_instance = read  # named, not sliced: a third of the cost
    e = _XidEventBuilder(xid, pci, pid, process, detail, record, gpu_instance, compute_instance)
    e.__class__ = XidEvent
    return e


def _read_xid(message: str) -> tuple[int, str, str | None, str | None, str, int | None, int | None] | None:
    m = _XID.search(message)
    if m is None:
        return None
    rest = message[m.end():MAX_LINE].lstrip(",").strip()
    pid = process = None
    if rest.startswith("pid="):
        value, _, rest = rest[4:].partition(",")
        pid, rest = _field_value(value), rest.lstrip()
        if rest.startswith("name="):
            value, _, rest = rest[5:].partition(",")
            process, rest = _field_value(value), rest.lstrip()
    gi = int(m[5]) if m[5] is not None else None
    ci = int(m[6]) if m[6] is not None else None
    return int(m[7]), _bdf(m[1], m[2], m[3], m[4]), pid, process, rest.strip(), gi, ci


def parse_gpu_preamble(message: str) -> tuple[str, str] | None:
    """(pci, uuid) from the driver's "NVRM: GPU at PCI:0000:91:00: GPU-..." line, else None."""
    m = _PREAMBLE.search(message[:MAX_LINE])
    return (_bdf(m[1], m[2], m[3], m[4]), m[5]) if m else None


class XidRun:
    """The XID lines of one text among a batch's records: one event, logged at each of ``at`` (indices into the
    records, in order). A flood repeats a few texts: each is read once and its lines counted, not read one by one."""

    __slots__ = ("event", "at")  # a plain class: a dataclass costs every start about a millisecond to make

    def __init__(self, event: XidEvent, at: Sequence[int]):
        self.event = event  # with the first of them as its record
        self.at = at


class TextLines(Sequence[int]):
    """The indices of one text's lines among a batch's messages, in order: their number, the first and the last are
    known from the passes over the batch that found them (a judge asks no more of a flood's lines); the whole list is
    made only when it is asked for (a recovery in the batch, or times read line by line)."""

    __slots__ = ("_messages", "_text", "_count", "_first", "_last", "_all")

    def __init__(self, messages: Sequence[str], text: str, count: int, first: int, last: int):
        self._messages, self._text = messages, text
        self._count, self._first, self._last = count, first, last
        self._all: list[int] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k):  # type: ignore[override]
        if k == 0 or k == -self._count:
            return self._first
        if k == -1 or k == self._count - 1:
            return self._last
        return self._list()[k]

    def __iter__(self):
        return iter(self._list())

    def _list(self) -> list[int]:
        if self._all is None:
            text = self._text
            self._all = [i for i in range(self._first, self._last + 1) if self._messages[i] == text]
        return self._all


def collect_runs(records: Sequence[LogRecord]) -> tuple[list[XidRun], list[LoggedGpu], list[LogRecord]]:
    """The XID lines as runs of one text each, in the order each text first appears; the GPUs the driver named in
    preamble lines; the records that mention an XID in a form not read here (an unknown driver format must surface,
    not vanish)."""
    # A saved log's reader hands its records' messages apart (agent/node/kernel_scan.py RowRecords): a record is then
    # made only for the first line of each text, not for every line of a flood.
    messages = getattr(records, "messages", None)
    if messages is None:
        messages = [r.message for r in records]
    # Each text is read once: its number of lines, first and last found in one pass of C over the batch
    # (agent/core/log_rows.py), not by a step of Python for each line. In the order each text first appears.
    if not messages:
        return [], [], []
    n = len(messages)
    runs: list[XidRun] = []
    preambles: list[tuple[int, LoggedGpu]] = []  # (last line, the GPU it names)
    unread_texts: set[str] = set()
    for message, (count, first, last) in text_runs(messages if type(messages) is list else list(messages)).items():
        if "NVRM: " not in message:  # cheap filter: most kernel lines are not the NVIDIA driver's
            continue
        event = parse_xid(message, records[first])
        if event is not None:
            runs.append(XidRun(event, TextLines(messages, message, count, first, last)))
            continue
        preamble = parse_gpu_preamble(message)
        if preamble is not None:
            preambles.append((last, LoggedGpu(preamble[1], preamble[0])))
        elif XID_MARK in message:
            unread_texts.add(message)
    logged: dict[str, LoggedGpu] = {}
    for _, gpu in preambles:  # each address where the driver first named it ...
        logged.setdefault(gpu.pci, gpu)
    for _, gpu in sorted(preambles, key=lambda p: p[0]):  # ... and the GPU of the last line naming it
        logged[gpu.pci] = gpu
    unread = [records[i] for i in range(n) if messages[i] in unread_texts] if unread_texts else []
    return runs, list(logged.values()), unread


def collect(records: Iterable[LogRecord]) -> tuple[list[XidEvent], list[LoggedGpu], list[LogRecord]]:
    """collect_runs with one event per XID line, in the order of the lines."""
    records = list(records)
    runs, logged, unread = collect_runs(records)
    lines = sorted(i for run in runs for i in run.at)
    return [parse_xid(records[i].message, records[i]) for i in lines], logged, unread  # type: ignore[misc]


def entity_lookup(gpus: Sequence[GpuRef]) -> Callable[[str], Entity]:
    """PCI address -> entity. Earlier refs (NVML) win over later ones (driver preamble lines)."""
    by_pci: dict[str, GpuRef] = {}
    by_uuid: dict[str, GpuRef] = {}
    uuid_at: dict[str, str] = {}
    for gpu in gpus:
        pci = (gpu.pci or "").lower()
        if pci:
            by_pci.setdefault(pci, gpu)
        if gpu.uuid:
            by_uuid.setdefault(gpu.uuid, gpu)
            uuid_at.setdefault(pci, gpu.uuid)

    def entity(pci: str) -> Entity:
        gpu = by_pci.get(pci)
        if gpu is not None and gpu.index is None and gpu.uuid in by_uuid:
            gpu = by_uuid[gpu.uuid]  # named by the driver; NVML knows that UUID (and its index)
        if gpu is None:
            return Entity("gpu", pci, None, pci)
        e = gpu.entity
        if gpu.uuid and e.pci:
            return e
        # NVML lost the GPU (XID 79) and cannot say its UUID or address; the driver printed both.
        return Entity(e.kind, gpu.uuid or uuid_at.get(pci) or e.id, e.index, e.pci or pci, e.link)

    return entity
