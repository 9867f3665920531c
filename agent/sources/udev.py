"""Device events as the kernel announces them: a GPU that falls off the bus, an HCA whose driver goes away, a netdev
that disappears is a `remove` uevent the moment the kernel drops the device, where a poll of sysfs or NVML sees it
seconds later. Only a wake-up signal: the checks still decide from what they read.

Live: a pyudev netlink monitor of the kernel's uevents (no udevd needed, so it works in a container that shares the
host's network namespace), filtered to the subsystems the agent watches. Recorded: the scenario's `udev` file, one
event a line `ACTION SUBSYSTEM SYS_PATH` (docs/scenario-format.md), followed from where it ended when the monitor
was opened, as a live monitor sees only what happens after it starts. Either way `fileno()` is select()able (a
netlink socket, or an inotify watch on the scenario folder) and `poll()` returns what arrived without blocking.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.inotify import DirWatch, open_watch

log = logs.get_logger("gpuwarden.udev")
SUBSYSTEMS = ("pci", "infiniband", "net")  # GPUs and HCAs on the bus, the RDMA devices, their netdevs
ACTIONS = frozenset({"add", "remove", "change", "move", "online", "offline", "bind", "unbind"})
UDEV_FILE = "udev"  # in a scenario
_MAX_EVENTS = 1024  # taken per poll(): a storm is handed over in bounded batches
_MAX_LINE = 4096  # a recorded line longer than this is not an event
_MAX_READ = 1 << 20  # bytes of a recorded file taken per poll


class UdevEvent(NamedTuple):
    action: str  # "remove", "add", "change", ...
    subsystem: str  # "pci", "infiniband", "net"
    sys_path: str  # "/sys/devices/pci0000:15/0000:15:01.0/0000:18:00.0"

    @property
    def name(self) -> str:
        """The device's kernel name: a PCI address for pci, "mlx5_2" for infiniband, "ib0" for net."""
        return self.sys_path.rstrip("/").rsplit("/", 1)[-1]


class UdevMonitor:
    """The kernel's uevents for `subsystems`, from a netlink socket. Raises SourceError when no monitor can be had
    (netlink refused, no libudev): the caller then relies on its polls alone."""

    def __init__(self, subsystems: tuple[str, ...] = SUBSYSTEMS):
        try:
            # optional dependency: pyudev (or the libudev under it) may be missing on a node, and then the polls
            # alone serve (SourceError below); +4.5 ms (python -X importtime) to a preflight, which never monitors
            import pyudev

            self._monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            for subsystem in subsystems:
                self._monitor.filter_by(subsystem=subsystem)
            self._monitor.start()
        except ImportError as exc:
            raise SourceError(f"udev monitor: pyudev or libudev is not available: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - pyudev raises OSError, or its own errors for libudev failures
            raise SourceError(f"udev monitor: cannot listen to kernel uevents: {type(exc).__name__}: {exc}") from None
        self.subsystems = tuple(subsystems)

    def fileno(self) -> int:
        return self._monitor.fileno()

    def poll(self) -> list[UdevEvent]:
        """The events that arrived since the last poll (at most _MAX_EVENTS), without blocking."""
        out: list[UdevEvent] = []
        while len(out) < _MAX_EVENTS:
            try:
                device: Any = self._monitor.poll(timeout=0)
            except Exception as exc:  # noqa: BLE001 - a receive error (ENOBUFS after a storm) loses events, not us
                log.warning("udev receive failed", error=f"{type(exc).__name__}: {exc}")
                break
            if device is None:
                break
            out.append(UdevEvent(str(device.action or ""), str(device.subsystem or ""), str(device.sys_path)))
        return out

    def close(self) -> None:
        try:
            self._monitor.stop()
        except Exception:  # noqa: BLE001 - closing a socket that failed: nothing left to release
            pass


class RecordedUdev:
    """A scenario's `udev` file, followed as it grows (complete lines only; a file that shrinks is read again from
    its start). Lines that are not an event of a watched subsystem are counted in `malformed` and skipped."""

    def __init__(self, root: Path, subsystems: tuple[str, ...] = SUBSYSTEMS):
        self.path = Path(root) / UDEV_FILE
        self.subsystems = tuple(subsystems)
        self._inside = confine.scenario_prefix(root)
        self._offset = self._size()
        self._pending = b""
        self._watch: DirWatch | None = open_watch(Path(root))
        self.malformed = 0

    def fileno(self) -> int | None:
        """Readable when the scenario folder is written; None where inotify is not available (poll now and then)."""
        return self._watch.fileno() if self._watch is not None else None

    def poll(self) -> list[UdevEvent]:
        if self._watch is not None:
            self._watch.drain()  # before reading, so a write after this read wakes the next select
        size = self._size()
        if size < self._offset:
            self._offset, self._pending = 0, b""
        if size == self._offset:
            return []
        try:
            fd = confine.open_file(self.path, self._inside)
        except OSError as exc:
            raise SourceError(f"{self.path}: cannot read recorded udev events: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as f:
            f.seek(self._offset)
            data = f.read(min(size - self._offset, _MAX_READ))  # the rest at the next poll
        self._offset += len(data)
        complete, _, self._pending = (self._pending + data).rpartition(b"\n")
        if len(self._pending) > _MAX_LINE:  # a line without end: not an event, and not to be held in memory
            self._pending = b""
            self.malformed += 1
        out = []
        for line in complete.split(b"\n") if complete else []:
            event = self._parse(line)
            if event is None:
                self.malformed += 1
            elif event.subsystem in self.subsystems:
                out.append(event)
        return out

    @staticmethod
    def _parse(line: bytes) -> UdevEvent | None:
        if len(line) > _MAX_LINE:
            return None
        fields = line.decode(errors="replace").split()
        if len(fields) != 3 or fields[0] not in ACTIONS or not fields[2].startswith("/sys/"):
            return None
        return UdevEvent(*fields)

    def _size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return 0

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
