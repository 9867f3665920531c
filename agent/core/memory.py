"""The daemon's memory at idle: how many malloc arenas its threads may create, and giving back to the system what
start-up allocated and freed. glibc only; elsewhere (musl, another libc) both are no-ops.

Each thread that allocates while another holds the main arena gets an arena of its own (up to 8 per core), and each
keeps the pages it once used: a dozen mostly sleeping threads then hold megabytes no one uses. Start-up (imports, the
configuration, the first samples) frees more than it keeps, and the heap holds those pages until trimmed."""
from __future__ import annotations

import ctypes

M_ARENA_MAX = -8  # malloc.h
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None)  # the symbols the process already has: its libc
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def limit_arenas(n: int) -> bool:
    """At most `n` malloc arenas from now on (threads beyond share them). True where glibc took it."""
    lib = _glibc()
    return bool(lib is not None and lib.mallopt(M_ARENA_MAX, n))


def trim() -> bool:
    """Give the free pages of every arena back to the system. True where glibc released any."""
    lib = _glibc()
    return bool(lib is not None and lib.malloc_trim(0))
