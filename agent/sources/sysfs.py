"""Reads of kernel-provided files (/sys, /proc/driver/nvidia) under a configurable root.

Live the root is "/"; on a recorded node it is the scenario folder, so the same reading code runs
on both (node_exporter's --path.sysfs habit). Under a recorded root every read and listing is confined to the
scenario (confine.py): a symlink that leads out of it is refused with a SourceError.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..errors import SourceError
from . import confine


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

    def read_bytes(self, kernel_path: str) -> bytes:
        """The file's bytes as they are (a cmdline's NULs kept); OSError as open() raises it, SourceError if refused."""
        return confine.read_bytes(self._str(kernel_path), self._inside, dirs=self._dirs)

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
    seconds late (the link_downed count of flaps between polls), beside state that must be seen at once."""

    def __init__(self, sysfs: Sysfs, list_files: Callable[[Sysfs], list[str]],
                 slow: Callable[[str], bool] | None = None, slow_every: int = 1):
        self.sysfs, self.list_files = sysfs, list_files
        self.slow, self.slow_every = slow, max(1, slow_every)
        self._fast: list[int] = []
        self._slow: list[int] = []
        self._reference: tuple[list[bytes], list[bytes]] | None = None
        self._looks = 0

    def rearm(self) -> None:
        self.close()
        try:
            for path in self.list_files(self.sysfs):
                (self._slow if self.slow is not None and self.slow(path) else self._fast).append(
                    self.sysfs.open_fd(path))
            self._reference = (_pread_all(self._fast), _pread_all(self._slow))
        except (SourceError, OSError):
            self._reference = None  # no reference: every look is a change, so every poll samples in full

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

    def close(self) -> None:
        for fd in (*self._fast, *self._slow):
            os.close(fd)
        self._fast, self._slow, self._reference = [], [], None


def _pread_all(fds: list[int]) -> list[bytes]:
    return [os.pread(fd, 4096, 0) for fd in fds]
