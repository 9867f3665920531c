"""Reads of kernel-provided files (/sys, /proc/driver/nvidia) under a configurable root.

Live the root is "/"; on a recorded node it is the scenario folder, so the same reading code runs
on both (node_exporter's --path.sysfs habit).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import SourceError


class Sysfs:
    def __init__(self, root: Path | str = "/"):
        self.root = Path(root)
        # Reads build the path by string: the daemon reads dozens of small files a second, and pathlib's
        # parsing was most of the cost of a 1 s IB-port poll.
        self._prefix = str(self.root).rstrip("/") + "/"

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
            with open(p, errors="replace") as f:
                return f.read().strip()
        except FileNotFoundError:
            raise SourceError(f"{p}: missing") from None
        except OSError as exc:
            raise SourceError(f"{p}: cannot read: {exc.strerror or exc}") from None

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
            return sorted(os.listdir(p))
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
