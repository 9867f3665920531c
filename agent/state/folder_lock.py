"""One daemon per state folder: a lock on its `gpuwarden.lock` (flock, released by the kernel when its holder dies),
the PID that holds it written in the file, so that a second daemon's error names the first.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from gpuwarden.agent.state.store_errors import StateInUse, StoreError

LOCK_NAME = "gpuwarden.lock"


def take_lock(folder: Path) -> int:
    """flock on the state folder's lock file, the holder's PID written in it; its descriptor. Raises StateInUse
    naming the holder."""
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StoreError(f"{path}: cannot open the lock file: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read_pid(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StateInUse(f"{folder} is in use by another gpuwarden daemon "
                             f"({'pid ' + holder if holder else 'pid unknown'}, lock {path})") from None
        raise StoreError(f"{path}: cannot lock: {exc.strerror or exc}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holds_lock(fd: int | None, folder: Path) -> bool:
    """Whether the lock file we hold is still the one in the folder (it goes with a deleted folder)."""
    if fd is None:
        return False
    try:
        held, there = os.fstat(fd), (folder / LOCK_NAME).stat()
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isascii() and text.isdigit() else ""
