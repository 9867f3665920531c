"""The kernel log: /dev/kmsg live (records since boot, non-blocking), a plain file on a recorded node.

The cursor (last sequence number + boot_id) is what the daemon persists so a restart neither misses
nor repeats a record; `read_since` honours it.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ParseError, SourceError
from ..kernel_log import LogRecord, parse_kmsg_text

DEV_KMSG = "/dev/kmsg"


@dataclass(frozen=True)
class Cursor:
    boot_id: str | None
    seq: int


class KernelLog:
    def __init__(self, path: Path | str, live: bool, boot_id: str | None = None, name: str | None = None):
        self.path = Path(path)
        # How records name their source in findings: stable across machines ("kmsg" in a scenario), so
        # golden outputs and evidence do not depend on where a scenario was unpacked.
        self.name = name or str(self.path)
        self.live = live
        self.boot_id = boot_id
        self.parse_errors: list[ParseError] = []

    def raw_text(self) -> str:
        """The log as /dev/kmsg records, one a line (what `record` saves)."""
        return self._read_text()

    def _read_text(self) -> str:
        if not self.live:
            try:
                return self.path.read_text(errors="replace")
            except FileNotFoundError:
                raise SourceError(f"{self.path}: kernel log missing") from None
            except OSError as exc:
                raise SourceError(f"{self.path}: cannot read kernel log: {exc.strerror or exc}") from None
        # /dev/kmsg returns one record per read() and EAGAIN at the end in non-blocking mode.
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise SourceError(f"{self.path}: cannot open kernel log: {exc.strerror or exc}") from None
        chunks: list[str] = []
        try:
            while True:
                try:
                    data = os.read(fd, 8192)
                except OSError as exc:
                    if exc.errno == errno.EAGAIN:
                        break
                    if exc.errno == errno.EPIPE:  # the ring buffer overwrote records we had not read
                        continue
                    raise SourceError(f"{self.path}: read failed: {exc.strerror}") from None
                if not data:
                    break
                chunks.append(data.decode(errors="replace"))
        finally:
            os.close(fd)
        return "".join(c if c.endswith("\n") else c + "\n" for c in chunks)

    def records(self) -> list[LogRecord]:
        """Every record available now. Malformed records are kept in `parse_errors`, not raised."""
        records, errors = parse_kmsg_text(self._read_text(), self.name)
        self.parse_errors = errors
        return records

    def read_since(self, cursor: Cursor | None) -> tuple[list[LogRecord], Cursor]:
        records = self.records()
        if cursor is not None and cursor.boot_id == self.boot_id:
            records = [r for r in records if r.seq is not None and r.seq > cursor.seq]
        last = max((r.seq for r in records if r.seq is not None), default=cursor.seq if cursor else -1)
        return records, Cursor(self.boot_id, last)
