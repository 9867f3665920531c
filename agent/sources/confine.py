"""A recorded node (a scenario) is a bundle from another machine: every file a source reads from it must lie inside
it. A symlink in the bundle that resolves elsewhere (`sys/.../state -> /root/.ssh/id_rsa`) is refused with a
SourceError naming the path, before anything is opened; so is a file that is not a regular file (a FIFO would block,
a device could act on open). Live reads (root "/") are not confined.
"""
from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

from gpuwarden.agent.core.errors import SourceError


def scenario_prefix(root: Path | str) -> str | None:
    """The resolved root with a trailing "/", what every path read under it must start with once resolved; None for
    the live root "/" (nothing to confine). Resolved once: a source keeps it for its lifetime."""
    real = os.path.realpath(root)
    return None if real == "/" else real.rstrip("/") + "/"


# The resolved form of each directory read under a scenario, kept by a source for a short while (Sysfs keeps one
# such dict): resolving a path costs a system call per component (a dozen in a recorded sysfs), and a preflight reads
# hundreds of files from a few dozen directories. Only directories are kept: a file's own name is never resolved from
# here (see open_file). Within DIR_TTL_S a directory that becomes a link is followed where it led when it was
# resolved, as a race between resolving and opening would; after that it is resolved again.
DIR_TTL_S = 1.0
_DIR_CACHE_MAX = 4096
Dirs = dict[str, tuple[float, str]]


def _real_dir(text: str, dirs: Dirs | None) -> str:
    if dirs is None:
        return os.path.realpath(text)
    now = time.monotonic()
    hit = dirs.get(text)
    if hit is not None and now - hit[0] < DIR_TTL_S:
        return hit[1]
    real = os.path.realpath(text)
    if len(dirs) >= _DIR_CACHE_MAX:
        dirs.clear()
    dirs[text] = (now, real)
    return real


def _inside(real: str, prefix: str) -> bool:
    return (real + "/").startswith(prefix)


def check(path: str | Path, prefix: str | None) -> str:
    """`path` as a string when it resolves inside the scenario (or `prefix` is None); else a SourceError. Under a
    scenario the string is the resolved path: what is opened or listed is what was checked."""
    text = os.fspath(path)
    if prefix is None:
        return text
    real = os.path.realpath(text)
    if not _inside(real, prefix):
        raise SourceError(f"{text}: resolves outside the recorded node; not read")
    return real


def check_dir(path: str | Path, prefix: str | None, dirs: Dirs | None = None) -> str:
    """check() for a directory (a listing), its resolution kept in `dirs` as open_file keeps a file's directory's."""
    text = os.fspath(path)
    if prefix is None:
        return text
    real = _real_dir(text, dirs)
    if not _inside(real, prefix):
        raise SourceError(f"{text}: resolves outside the recorded node; not read")
    return real


def _resolved_parent(text: str, prefix: str, dirs: Dirs | None) -> str | None:
    """The path of `text` with its directory resolved (from the cache) when that lies inside the scenario; None when
    the directory does not, or the name is one resolving would change ("", ".", "..")."""
    head, _, name = text.rpartition("/")
    if not head or name in ("", ".", ".."):
        return None
    real = _real_dir(head, dirs)
    return real.rstrip("/") + "/" + name if _inside(real, prefix) else None


def open_file(path: str | Path, prefix: str | None, dirs: Dirs | None = None) -> int:
    """A read-only descriptor of `path`, confined to the scenario and, there, to regular files. Raises OSError as
    os.open does (the caller words it), SourceError when refused. `dirs`: the caller's resolved directories."""
    text = os.fspath(path)
    if prefix is None:
        return os.open(text, os.O_RDONLY | os.O_CLOEXEC)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    fast = _resolved_parent(text, prefix, dirs)
    fd = -1
    if fast is not None:
        try:  # the name itself is not followed: a link there (ELOOP) is resolved in full below
            fd = os.open(fast, flags | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
    if fd < 0:
        fd = os.open(check(text, prefix), flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{text}: not a regular file; not read")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | Path, prefix: str | None, limit: int | None = None, *, dirs: Dirs | None = None) -> bytes:
    """The whole file, confined as open_file(); with `limit`, at most limit + 1 bytes (a caller that sees more than
    `limit` knows the file is too large without having read it all). Raises OSError as open() does, SourceError when
    refused."""
    fd = open_file(path, prefix, dirs)
    with os.fdopen(fd, "rb") as f:
        return f.read() if limit is None else f.read(limit + 1)


def read_text(path: str | Path, prefix: str | None) -> str:
    return read_bytes(path, prefix).decode(errors="replace")
