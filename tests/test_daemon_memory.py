"""The daemon's malloc settings (agent/memory.py) take on this glibc host, and the daemon imports nothing at start that
only one-shot commands use (each module is resident memory for the agent's whole life)."""
from __future__ import annotations

import subprocess
import sys

from gpuwarden.agent import memory


def test_arena_limit_and_trim_take_on_glibc():
    assert memory.limit_arenas(8) is True
    blocks = [bytes(8000) for _ in range(4000)]  # malloc'd (above pymalloc's 512 bytes), below the mmap threshold
    kept = blocks[::8]  # every eighth kept: the heap cannot shrink from its top, only trim frees the pages between
    del blocks
    assert memory.trim() is True and len(kept) == 500


def test_the_daemons_modules_leave_out_what_it_does_not_use():
    code = ("import sys; import gpuwarden.agent.daemon, gpuwarden.checks, gpuwarden.agent.sources.nvml; "
            "print(' '.join(m for m in ('statistics', 'fractions', 'decimal') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []
