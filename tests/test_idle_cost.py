"""What keeps the idle daemon small and cheap, beside tests/test_daemon_idle.py: its malloc settings (agent/memory.py)
take on this glibc host, it imports nothing that only one-shot commands use (each module is resident memory for the
agent's whole life), and an idle GPU does not keep the clock-event poll judging and writing."""
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
    code = ("import sys; import gpuwarden.agent.daemon, gpuwarden.checks, gpuwarden.agent.sources.nvml, "
            "gpuwarden.agent.topology; "
            "print(' '.join(m for m in ('statistics', 'fractions', 'decimal', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []


def test_an_idle_gpu_is_a_quiet_clock_state():
    """gpu_idle (the bit every idle GPU reports) and the other reasons that are not judged leave the state quiet: the
    daemon does not judge and write the same unthrottled readings every 10 s; a judged reason makes it not quiet."""
    from gpuwarden.checks import clock_events

    def state(*masks, read_once=False):
        buckets = [] if read_once else [{"t": 0.0, "obs": 10.0, "on": {"gpu_idle": 10.0}}]
        return {"gpus": {f"GPU-{i}": {"last_mask": m, "last_t": 10.0, "buckets": buckets}
                         for i, m in enumerate(masks)}}

    assert clock_events.quiet(state(0x1, 0x1 | 0x4, 0x10 | 0x2, 0x0))
    for judged in ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown"):
        assert not clock_events.quiet(state(0x1, 0x1 | clock_events.REASONS[judged]))
    assert not clock_events.quiet(state(0x1, read_once=True))  # the second reading gives the ratios a value
