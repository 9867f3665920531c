"""Reads of kernel-provided files (/sys, /proc/driver/nvidia) under a configurable root.

Live the root is "/"; on a recorded node it is the scenario folder, so the same reading code runs
on both (node_exporter's --path.sysfs habit). Under a recorded root every read and listing is confined to the
scenario (confine.py): a symlink that leads out of it is refused with a SourceError.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Protocol

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.inotify import DirWatch, open_watch

log = logs.get_logger("gpuwarden.sysfs")


class Sysfs:
    def __init__(self, root: Path | str = "/"):
        self.root = Path(root)
        # Reads build the path by string: the daemon reads dozens of small files a second, and pathlib's
        # parsing was most of the cost of a 1 s IB-port poll.
        self._prefix = str(self.root).rstrip("/") + "/"
        self._inside = confine.scenario_prefix(self.root)  # None live: no per-read cost there
        self._dirs: confine.Dirs = {}  # directories resolved under a recorded root (confine.py)

    def path(self, kernel_path: str) -> Path:
        """Map an absolute kernel path ("/sys/class/infiniband") under the root."""
        return self.root / kernel_path.lstrip("/")

    def _str(self, kernel_path: str) -> str:
        return self._prefix + kernel_path.lstrip("/")

    def exists(self, kernel_path: str) -> bool:
        return os.path.exists(self._str(kernel_path))

    def read(self, kernel_path: str) -> str:
        """The file's text without the trailing newline sysfs adds (captures sometimes lack it)."""
        p = self._str(kernel_path)
        try:
            # os-level reads: a text-mode open() costs three times as much, and the daemon polls these every second.
            fd = confine.open_file(p, self._inside, self._dirs)
            try:
                chunks = [os.read(fd, 65536)]
                while chunks[-1]:  # sysfs attributes fit one read; a recorded /proc file may not
                    chunks.append(os.read(fd, 65536))
            finally:
                os.close(fd)
            return b"".join(chunks).decode(errors="replace").strip()
        except FileNotFoundError:
            raise SourceError(f"{p}: missing") from None
        except OSError as exc:
            raise SourceError(f"{p}: cannot read: {exc.strerror or exc}") from None

    def read_bytes(self, kernel_path: str, limit: int | None = None) -> bytes:
        """The file's bytes as they are (a cmdline's NULs kept); with `limit`, at most limit + 1 of them (more than
        `limit` says the file is larger). OSError as open() raises it, SourceError if refused."""
        return confine.read_bytes(self._str(kernel_path), self._inside, limit, dirs=self._dirs)

    def open_fd(self, kernel_path: str) -> int:
        """A descriptor kept open for re-reading with os.pread(fd, n, 0): sysfs regenerates an attribute on every
        read at offset 0, without the path lookup an open() costs (and a removed device's file then fails)."""
        p = self._str(kernel_path)
        try:
            return confine.open_file(p, self._inside, self._dirs)
        except OSError as exc:
            raise SourceError(f"{p}: cannot open: {exc.strerror or exc}") from None

    def read_int(self, kernel_path: str) -> int:
        text = self.read(kernel_path)
        try:
            return int(text, 0)
        except ValueError:
            raise SourceError(f"{self._str(kernel_path)}: expected an integer, got {text[:40]!r}") from None

    def listdir(self, kernel_path: str) -> list[str]:
        """Sorted entries; a missing directory is an empty list (absence is the caller's signal)."""
        p = self._str(kernel_path)
        try:
            return sorted(os.listdir(p if self._inside is None else confine.check_dir(p, self._inside, self._dirs)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise SourceError(f"{p}: cannot list: {exc.strerror or exc}") from None

    def watch(self, kernel_dirs: list[str]) -> DirWatch:
        """An inotify watch on these folders (under a recorded root, confined to it): readable when a file in one
        of them is written. Live sysfs attributes raise no such event; this is for a recorded node's files, which
        a test or a replay writes. SourceError where no watch can be had."""
        if not kernel_dirs:
            raise SourceError("no folder to watch")
        try:
            real = [Path(self._str(d) if self._inside is None else confine.check_dir(self._str(d), self._inside,
                                                                                      self._dirs))
                    for d in kernel_dirs]
        except OSError as exc:
            raise SourceError(f"{exc.filename or kernel_dirs[0]}: cannot watch: {exc.strerror or exc}") from None
        watch = open_watch(*real)
        if watch is None:
            raise SourceError(f"{real[0]}: no inotify watch to be had here (see the log)")
        return watch

    def link_target_name(self, kernel_path: str) -> str | None:
        """Basename of a symlink's target (e.g. an HCA's PCI device), or None when it is not a link."""
        try:
            return os.path.basename(os.readlink(self._str(kernel_path)))
        except OSError:
            return None


class FileSetProbe:
    """A daemon ChangeProbe over sysfs files: the set is listed at each rearm() (just before a full sample), kept
    open, and re-read with pread by changed(). Most polls find nothing new, and this look costs a tenth of a
    sample: no listing, no path lookups, no parsing. A file that appears is seen at the next full sample; one
    whose device is removed fails its read (ENODEV): a change.

    `slow` files are re-read only every `slow_every`-th look: counters whose increase may be noticed a few
    seconds late (the link_downed count of flaps between polls), beside state that must be seen at once.

    `events(files)`, where given, opens a source of events that say when the files may have changed (the IB ports'
    events: agent/sources/ib_events.py); its descriptors are event_fds() and it is read at each rearm(). It is
    opened again when the files listed change, and after it failed (at most every EVENTS_RETRY_S); where it cannot
    be had the reason is logged once and the daemon looks at every interval, as without it."""

    def __init__(self, sysfs: Sysfs, list_files: Callable[[Sysfs], list[str]],
                 slow: Callable[[str], bool] | None = None, slow_every: int = 1,
                 events: Callable[[list[str]], Events] | None = None):
        self.sysfs, self.list_files = sysfs, list_files
        self.slow, self.slow_every = slow, max(1, slow_every)
        self._fast: list[int] = []
        self._slow: list[int] = []
        self._reference: tuple[list[bytes], list[bytes]] | None = None
        self._looks = 0
        self._open_events = events
        self._events: Events | None = None
        self._events_for: list[str] | None = None  # the files the events were opened (or refused) for
        self._events_retry = 0.0  # monotonic time before which events that failed are not opened again

    def rearm(self) -> None:
        self._close_files()
        files: list[str] | None = None
        try:
            files = self.list_files(self.sysfs)
            for path in files:
                (self._slow if self.slow is not None and self.slow(path) else self._fast).append(
                    self.sysfs.open_fd(path))
            self._reference = (_pread_all(self._fast), _pread_all(self._slow))
        except (SourceError, OSError):
            self._reference = None  # no reference: every look is a change, so every poll samples in full
        if self._open_events is not None and files is not None:
            self._arm_events(files)

    def _arm_events(self, files: list[str]) -> None:
        if files == self._events_for and (self._events is not None or time.monotonic() < self._events_retry):
            self._drain_events()  # what woke the loop, if anything: the sample that follows reads it all
            return
        self._close_events()
        self._events_for = files
        self._events_retry = float("inf")  # refused for these files until they change, or ...
        try:
            assert self._open_events is not None
            self._events = self._open_events(files)
        except SourceError as exc:
            log.info("change events unavailable, looking every interval", error=str(exc))
            return
        self._events_retry = 0.0  # ... opened: if they fail, opened again later
        self._drain_events()  # the reference just taken covers what they had queued

    def _drain_events(self) -> None:
        """Reads what the events hold; events that fail are closed, and opened again after EVENTS_RETRY_S."""
        if self._events is None:
            return
        try:
            self._events.drain()
        except SourceError as exc:
            log.warning("change events failed, looking every interval", error=str(exc))
            self._close_events()
            self._events_retry = time.monotonic() + EVENTS_RETRY_S

    def changed(self) -> bool:
        if self._reference is None:
            return True
        self._looks += 1
        try:
            if _pread_all(self._fast) != self._reference[0]:
                return True
            return self._looks % self.slow_every == 0 and _pread_all(self._slow) != self._reference[1]
        except OSError:
            return True

    def event_fds(self) -> list[int]:
        return self._events.fds() if self._events is not None else []

    def close(self) -> None:
        self._close_files()
        self._close_events()
        self._events_for = None

    def _close_files(self) -> None:
        for fd in (*self._fast, *self._slow):
            os.close(fd)
        self._fast, self._slow, self._reference = [], [], None

    def _close_events(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None


EVENTS_RETRY_S = 300.0  # events that failed (a device reset) are opened again after this; the files are looked at
#                         every interval meanwhile


class Events(Protocol):
    """A source of events that say when files may have changed: descriptors readable when one waits, drain() reads
    them (SourceError when the source failed), close()."""

    def fds(self) -> list[int]: ...

    def drain(self) -> int: ...

    def close(self) -> None: ...


def _pread_all(fds: list[int]) -> list[bytes]:
    return [os.pread(fd, 4096, 0) for fd in fds]
