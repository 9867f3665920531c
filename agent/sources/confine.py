"""A recorded node (a scenario) is a bundle from another machine: every file a source reads from it must lie inside
it. A symlink in the bundle that resolves elsewhere (`sys/.../state -> /root/.ssh/id_rsa`) is refused with a
SourceError naming the path, before anything is opened; so is a file that is not a regular file (a FIFO would block,
a device could act on open). Live reads (root "/") are not confined.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import SourceError


def scenario_prefix(root: Path | str) -> str | None:
    """The resolved root with a trailing "/", what every path read under it must start with once resolved; None for
    the live root "/" (nothing to confine). Resolved once: a source keeps it for its lifetime."""
    real = os.path.realpath(root)
    return None if real == "/" else real.rstrip("/") + "/"


def check(path: str | Path, prefix: str | None) -> str:
    """`path` as a string when it resolves inside the scenario (or `prefix` is None); else a SourceError."""
    text = os.fspath(path)
    if prefix is not None and not (os.path.realpath(text) + "/").startswith(prefix):
        raise SourceError(f"{text}: resolves outside the recorded node; not read")
    return text


def open_file(path: str | Path, prefix: str | None) -> int:
    """A read-only descriptor of `path`, confined to the scenario and, there, to regular files. Raises OSError as
    os.open does (the caller words it), SourceError when refused."""
    text = check(path, prefix)
    if prefix is None:
        return os.open(text, os.O_RDONLY | os.O_CLOEXEC)
    fd = os.open(text, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{text}: not a regular file; not read")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | Path, prefix: str | None, limit: int | None = None) -> bytes:
    """The whole file, confined as open_file(); with `limit`, at most limit + 1 bytes (a caller that sees more than
    `limit` knows the file is too large without having read it all). Raises OSError as open() does, SourceError when
    refused."""
    fd = open_file(path, prefix)
    with os.fdopen(fd, "rb") as f:
        return f.read() if limit is None else f.read(limit + 1)


def read_text(path: str | Path, prefix: str | None) -> str:
    return read_bytes(path, prefix).decode(errors="replace")
