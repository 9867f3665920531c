"""Wake when a folder's files change, without polling: Linux inotify through libc.

A recorded node's kernel log is a plain file that a test (or `gpuwarden record` replaying a capture) appends
to. Polling it every 20 ms cost about half of the daemon's idle CPU; an inotify descriptor is select()able,
so the follower sleeps until the file is written, exactly as it sleeps on live /dev/kmsg.

The folder is watched rather than the file, so a file replaced by rename (an editor, an atomic rewrite) is
still seen. Where inotify is not available (not Linux, no libc, the per-user watch limit reached) `open_watch`
returns None and the caller falls back to a timed poll.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import time
from pathlib import Path
from typing import Any

from gpuwarden.agent.core import logs

log = logs.get_logger("gpuwarden.inotify")

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_CHANGES = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE

_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        except OSError:
            return None
    return _libc


class DirWatch:
    """A non-blocking inotify descriptor on one folder. `fileno()` is readable when something in it changed;
    `drain()` empties the queue (the events themselves are not needed: the caller re-reads what it follows)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> None:
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass  # empty: the normal end
        except OSError as exc:
            log.warning("inotify read failed", path=str(self.path), error=exc.strerror)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # an owner dropped without close() (a recorded NVML replaced on reload)
        self.close()


def open_watch(folder: Path, *more: Path) -> DirWatch | None:
    """A watch on the entries of `folder` (and of `more` folders, on the same descriptor), or None (with the reason
    logged) when inotify cannot be used here."""
    libc = _load_libc()
    if libc is None or not hasattr(libc, "inotify_init1"):
        return None
    fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        log.info("inotify unavailable, polling instead", path=str(folder), error=os.strerror(ctypes.get_errno()))
        return None
    for one in (folder, *more):
        if libc.inotify_add_watch(fd, os.fsencode(one), _CHANGES) < 0:
            # ENOSPC: fs.inotify.max_user_watches reached; ENOENT: the folder is gone. Polling still works.
            log.info("inotify watch refused, polling instead", path=str(one), error=os.strerror(ctypes.get_errno()))
            os.close(fd)
            return None
    return DirWatch(fd, Path(folder))


class FolderWaiter:
    """Sleeps until something in a folder is written, at most a timeout: on an inotify watch where one can be had,
    else a timed poll. The first wait arms the watch and returns at once, because a write made before the watch
    existed raised no event: the caller reads once more before it sleeps. After a wake-up the caller re-reads
    what it follows either way, so a spurious wake costs one look."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._watch: DirWatch | None = None
        self._armed = False

    def wait(self, timeout_s: float, poll_tick_s: float, wake_fd: int | None = None) -> None:
        """At most `timeout_s` (`poll_tick_s` without a watch); returns early when `wake_fd` is readable."""
        if not self._armed:
            self._armed = True
            self._watch = open_watch(self.folder)
            if self._watch is not None:
                return
        fds: list[Any] = [] if wake_fd is None else [wake_fd]
        timeout = min(timeout_s, poll_tick_s)
        if self._watch is not None:
            fds.append(self._watch)
            timeout = timeout_s
        if not fds:
            time.sleep(max(0.0, timeout))
            return
        try:
            ready = select.select(fds, [], [], max(0.0, timeout))[0]
        except (OSError, ValueError):  # a descriptor closed under us: poll rather than spin
            time.sleep(max(0.0, min(timeout_s, poll_tick_s)))
            return
        if self._watch is not None and self._watch in ready:
            self._watch.drain()  # before the caller reads, so no later write is missed

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._watch, self._armed = None, False
