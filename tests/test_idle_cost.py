"""What keeps the idle daemon small and cheap, beside tests/test_daemon_idle.py: its malloc settings
(agent/core/memory.py) take on this glibc host, it imports nothing that only one-shot commands use (each module is
resident memory for the agent's whole life), and an idle GPU does not keep the clock-event poll judging and writing."""
from __future__ import annotations

import subprocess
import sys

from gpuwarden.agent.core import memory


def test_arena_limit_and_trim_take_on_glibc():
    assert memory.limit_arenas(8) is True
    blocks = [bytes(8000) for _ in range(4000)]  # malloc'd (above pymalloc's 512 bytes), below the mmap threshold
    kept = blocks[::8]  # every eighth kept: the heap cannot shrink from its top, only trim frees the pages between
    del blocks
    assert memory.trim() is True and len(kept) == 500


def test_the_daemons_modules_leave_out_what_it_does_not_use():
    code = ("import sys; import gpuwarden.agent.daemon.loop, gpuwarden.checks, gpuwarden.agent.sources.nvml, "
            "gpuwarden.agent.node.topology; "
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


def test_a_quiet_state_judges_the_same_sample_the_same_later(scenario_copy, tmp_path):
    """What the daemon relies on when it leaves a quiet check's unchanged sample unjudged (PassiveSpec.quiet): on every
    bundled healthy node, a check whose state is quiet and whose judgement holds no finding gives the same findings for
    the same sample judged again up to its quiet_rejudge_s later (a fabric registration in progress, timed, is not
    quiet)."""
    import json
    import shutil

    from conftest import NODES, edit_nvml
    from gpuwarden.agent.core import config
    from gpuwarden.agent.core.errors import GpuwardenError
    from gpuwarden.agent.node.host import Node
    from gpuwarden.checks import PASSIVE, all_specs

    def registering(data):  # one GPU's fabric registration still in progress: timed, so never quiet
        data["gpus"][0]["fabric"]["state"] = 2

    cfgs = config.defaults(all_specs())
    seen = set()
    for scenario, edit in (("h100-hgx-healthy", None), ("gb200-nvl72-healthy", None), ("gb200-nvl72-faulty", None),
                           ("h200-vm-1gpu", None), ("gb200-nvl72-healthy", registering)):
        if edit is None:
            root = scenario_copy(scenario)
        else:
            root = tmp_path / "edited"
            shutil.copytree(NODES / scenario, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
            edit_nvml(root, edit)
        node = Node.recorded_at(root)
        for spec in (s for s in PASSIVE if s.quiet is not None):
            cfg = cfgs.for_check(spec.name)
            t0 = 1_760_000_000.0
            try:
                first = spec.judge({}, spec.sample(node, cfg, {}), cfg, t0)
                state = json.loads(json.dumps(first.state))
                sample = spec.sample(node, cfg, state)
            except GpuwardenError:
                continue  # not applicable on this node (no IB port, no fabric)
            now = t0 + spec.interval_s
            judged = spec.judge(state, sample, cfg, now)
            state = json.loads(json.dumps(judged.state))
            if judged.findings or not spec.quiet(state):
                continue
            seen.add(spec.name)
            later = spec.judge(state, sample, cfg, now + 0.9 * spec.quiet_rejudge_s)
            assert later.findings == judged.findings, (scenario, spec.name)
    assert {"fabric", "nccl_sweep", "clock_events", "ib_port", "nvlink_lanes", "thermal"} <= seen, seen
