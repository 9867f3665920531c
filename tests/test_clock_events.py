"""clock_events driven through time on a recorded node: nvml.json's clocks_event_reasons is edited between steps,
`now` advances by the production interval, and the state goes through JSON between steps (as the daemon persists
it). The power-brake bitmask is read from a real `nvidia-smi -q` capture of 8x H100 with the brake active."""
from __future__ import annotations

import re

import pynvml
import pytest
from conftest import ROOT, PassiveClock, edit_nvml
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import clock_events
from gpuwarden.checks.clock_events import REASONS, SPEC

SMI = ROOT / "fixtures/tools/nvidia-smi"
BRAKE_CAPTURE = SMI / "gpud__nvidia-smi-q__8xH100-SXM__535.161.08__hw-power-brake-slowdown-active.txt"
IDLE_CAPTURE = SMI / "gpud__nvidia-smi-q__8xH100-SXM__535.183.01__idle.txt"
# nvidia-smi -q's labels of the "Clocks Event Reasons" block -> this module's reason names
SMI_LABELS = {"Idle": "gpu_idle", "Applications Clocks Setting": "applications_clocks_setting",
              "SW Power Cap": "sw_power_cap", "HW Slowdown": "hw_slowdown",
              "HW Thermal Slowdown": "hw_thermal_slowdown",
              "HW Power Brake Slowdown": "hw_power_brake_slowdown", "Sync Boost": "sync_boost",
              "SW Thermal Slowdown": "sw_thermal_slowdown", "Display Clock Setting": "display_clock_setting"}
IDLE, HW, THERMAL, BRAKE, SW_THERMAL, POWER_CAP = 0x1, 0x8, 0x48, 0x88, 0x20, 0x4
T0 = 1_760_000_000.0
STEP_S = 5.0  # readings every 5 s: the window arithmetic does not depend on the production interval


def smi_masks(path) -> list[int]:
    """Per GPU, the bitmask an `nvidia-smi -q` capture's "Clocks Event Reasons" block says was active."""
    masks, inside = [], False
    for line in path.read_text().splitlines():
        if line.strip() in ("Clocks Event Reasons", "Clocks Throttle Reasons"):
            masks.append(0)
            inside = True
            continue
        m = re.match(r"^\s+(.+?)\s+:\s+(Active|Not Active)\s*$", line) if inside else None
        if not m:
            inside = False
            continue
        if m.group(2) == "Active":
            masks[-1] |= REASONS[SMI_LABELS[m.group(1)]]
    return masks


def cfg(**overrides):
    return {**SPEC.defaults, **overrides}


def set_masks(root, masks: dict[int, int], errors: dict[int, dict] | None = None) -> None:
    def change(data):
        for g in data["gpus"]:
            if g["index"] in masks:
                g["clocks_event_reasons"] = masks[g["index"]]
            if errors and g["index"] in errors:
                g["errors"] = errors[g["index"]]

    edit_nvml(root, change)


class Drive(PassiveClock):
    """Steps the check through time like the daemon (tests/conftest.py PassiveClock)."""

    def __init__(self, root, **overrides):
        super().__init__(SPEC, root, cfg(**overrides), T0, STEP_S)


def codes(j, gpu: int | None = None):
    return sorted((f.entity.index, f.code, f.status) for f in j.findings if gpu is None or f.entity.index == gpu)


def metric(j, name, gpu, reason):
    (value,) = [m.value for m in j.metrics if m.name == name and m.labels["gpu"] == str(gpu)
                and m.labels["reason"] == reason]
    return value


def test_reason_table_matches_pynvml():
    snake = lambda camel: re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()  # noqa: E731
    names = [n for n in dir(pynvml) if n.startswith("nvmlClocksEventReason")]
    ours = {snake(n[len("nvmlClocksEventReason"):]): getattr(pynvml, n) for n in names
            if n[len("nvmlClocksEventReason"):] not in ("All", "None", "UserDefinedClocks")}  # UserDefined = 0x2 alias
    assert ours == REASONS
    for name, bit in REASONS.items():  # the deprecated Throttle names carry the same bits
        camel = "".join(w.capitalize() for w in name.split("_"))
        assert getattr(pynvml, f"nvmlClocksThrottleReason{camel}") == bit


def test_real_capture_power_brake_bits():
    assert smi_masks(BRAKE_CAPTURE) == [BRAKE] * 8  # HW Slowdown + HW Power Brake Slowdown on every GPU
    assert clock_events.active_reasons(BRAKE) == ["hw_slowdown", "hw_power_brake_slowdown"]
    # The "idle" capture's GPU 2 has SW power cap + HW power brake + SW thermal active and HW Slowdown NOT active:
    # the umbrella bit does not always come with its specific causes.
    assert smi_masks(IDLE_CAPTURE) == [IDLE, IDLE, 0xA4, IDLE, IDLE, IDLE, IDLE, IDLE]


def test_real_brake_without_the_umbrella_bit(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_masks(root, dict(enumerate(smi_masks(IDLE_CAPTURE))))
    j = Drive(root).run(120)
    assert codes(j) == [(2, "hw-power-brake-slowdown", Status.FAIL), (2, "sw-thermal-slowdown", Status.WARN)]


def test_healthy_node_has_no_findings_but_metrics(scenario_copy):
    d = Drive(scenario_copy("h100-hgx-healthy"))
    j = d.run(600)
    assert j.findings == ()
    assert metric(j, "gpuwarden_gpu_clock_event_active", 0, "gpu_idle") == 1.0
    assert metric(j, "gpuwarden_gpu_clock_event_ratio", 0, "gpu_idle") == 1.0
    assert metric(j, "gpuwarden_gpu_clock_event_ratio", 2, "gpu_idle") == 0.0  # GPU 2 is not idle in the scenario
    uuids = {m.labels["uuid"] for m in j.metrics if m.labels["gpu"] == "0"}
    assert uuids == {"GPU-566e6f65-c38e-b12f-4824-6944218668b9"}


def test_one_sample_spike_does_not_even_warn(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = Drive(root)
    d.run(300)
    set_masks(root, {3: BRAKE})
    j = d.tick()
    assert metric(j, "gpuwarden_gpu_clock_event_active", 3, "hw_power_brake_slowdown") == 1.0
    assert j.findings == ()
    set_masks(root, {3: IDLE})
    for _ in range(80):
        j = d.tick()
        assert j.findings == ()
    assert metric(j, "gpuwarden_gpu_clock_event_ratio", 3, "hw_power_brake_slowdown") == 0.0  # aged out


def test_sustained_power_brake_fails_then_clears(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_masks(root, {i: m for i, m in enumerate(smi_masks(BRAKE_CAPTURE)) if i == 5})
    d = Drive(root)
    j = d.run(55)  # under min_window_s: measured and exported, not judged
    assert j.findings == ()
    assert metric(j, "gpuwarden_gpu_clock_event_ratio", 5, "hw_power_brake_slowdown") == 1.0
    j = d.run(10)
    (f,) = j.findings
    assert (f.entity.index, f.code, f.status, f.action) == (5, "hw-power-brake-slowdown", Status.FAIL, Action.DRAIN)
    assert f.evidence["ratio"]["hw_power_brake_slowdown"] == 1.0 and f.evidence["clocks_event_reasons"] == "0x88"
    assert f.evidence["active_now"] == ["hw_slowdown", "hw_power_brake_slowdown"]  # no separate hw-slowdown finding
    assert f.entity.id == "GPU-06db64f6-6181-5a90-cf95-5ce52a58c4e5" and "power" in f.message

    set_masks(root, {5: 0})  # the brake is released: the fraction decays over the window
    seen = []
    for _ in range(70):
        j = d.tick()
        seen.append(tuple(f.status for f in j.findings))
    assert seen[0] == (Status.FAIL,) and seen[-1] == ()
    assert (Status.WARN,) in seen  # FAIL -> WARN -> nothing as the brake ages out of the window
    assert seen.index((Status.WARN,)) < seen.index(())


@pytest.mark.parametrize("mask, code, status", [
    (HW, "hw-slowdown", Status.FAIL),
    (THERMAL, "hw-thermal-slowdown", Status.FAIL),
    (SW_THERMAL, "sw-thermal-slowdown", Status.WARN),
    (POWER_CAP, None, None),  # a power cap is policy, not a fault
    (0x10 | 0x2 | 0x100, None, None),  # sync boost, application clocks, display clocks
])
def test_each_reason(scenario_copy, mask, code, status):
    root = scenario_copy("h100-hgx-healthy")
    set_masks(root, {1: mask})
    j = Drive(root).run(120)
    assert codes(j) == ([(1, code, status)] if code else [])


def test_intermittent_brake_below_fail_ratio_warns(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = Drive(root)
    for _ in range(6):  # braked at one reading, then 45 s unbraked: under a fifth of the time
        set_masks(root, {0: BRAKE})
        d.tick()
        set_masks(root, {0: IDLE})
        j = d.run(45)
    (f,) = j.findings
    assert (f.code, f.status, f.action) == ("hw-power-brake-slowdown", Status.WARN, Action.MONITOR)
    assert 0.04 <= f.evidence["ratio"]["hw_power_brake_slowdown"] < 0.2 and "watch it" in f.message


def test_state_survives_a_restart_and_gaps_are_unobserved(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_masks(root, {4: BRAKE})
    d = Drive(root)
    d.run(40)
    d.node = Node.recorded_at(root)  # a restarted daemon: a new node, the persisted state
    j = d.run(25)
    assert codes(j, 4) == [(4, "hw-power-brake-slowdown", Status.FAIL)]
    assert j.findings[0].evidence["observed_s"] == 60.0  # the first reading credits nothing

    d.tick(3600)  # the daemon was down an hour: the old window is gone and the gap is credited to nothing
    j = d.tick()
    assert codes(j) == [] and metric(j, "gpuwarden_gpu_clock_event_ratio", 4, "hw_power_brake_slowdown") == 1.0
    assert j.state["gpus"]["GPU-726d356b-f548-bbfd-c81e-b9c68f2f1587"]["buckets"][0]["obs"] == 5.0


def test_state_is_bounded(scenario_copy):
    d = Drive(scenario_copy("h100-hgx-healthy"))
    d.run(3000)
    assert all(len(g["buckets"]) <= clock_events.BUCKETS + 1 for g in d.state["gpus"].values())


def test_lost_gpu_fails_through_per_gpu_and_keeps_its_window(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = Drive(root)
    d.run(100)
    set_masks(root, {}, errors={2: {"*": "GPU_IS_LOST"}})
    j = d.tick()
    (f,) = j.findings
    assert (f.entity.index, f.code, f.status, f.action) == (2, "gpu-lost", Status.FAIL, Action.REBOOT)
    assert f.entity.id == "GPU-973565ff-45cf-12ea-4e91-33386720f7bb"  # named from the driver's view
    assert "GPU-973565ff-45cf-12ea-4e91-33386720f7bb" in j.state["gpus"]
    assert not [m for m in j.metrics if m.labels["gpu"] == "2"]
    d.run(400)
    assert "GPU-973565ff-45cf-12ea-4e91-33386720f7bb" not in d.state["gpus"]  # aged out of the window


def test_other_nvml_error_is_unknown_for_that_gpu(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_masks(root, {6: BRAKE}, errors={6: {"nvmlDeviceGetCurrentClocksEventReasons": "UNKNOWN"}})
    j = Drive(root).run(120)
    assert codes(j) == [(6, "nvml-error", Status.UNKNOWN)]


def test_metric_names_and_help():
    for name in ("gpuwarden_gpu_clock_event_ratio", "gpuwarden_gpu_clock_event_active"):
        assert re.fullmatch(r"gpuwarden_[a-z_]+", name) and not name.endswith("_total")
    j = clock_events.judge({}, clock_events.ClockSample((), ()), cfg(), T0)
    assert j == clock_events.Judgement({"gpus": {}}, (), ())


def test_a_quiet_gpu_window_is_credited_through_the_daemons_skipped_samples(scenario_copy, tmp_path):
    """The daemon leaves a quiet check's identical samples unjudged and judges again after quiet_rejudge_s, at the
    next tick; that judgement must come within max_gap_s, or the skipped stretch counts as unobserved and an idle
    GPU's window never fills. The real daemon, on the check's production timings scaled down 20 times."""
    import time
    from dataclasses import replace

    from conftest import wait_for
    from gpuwarden.agent.core import config
    from gpuwarden.checks import all_specs
    from test_daemon_idle import one_check_daemon

    scale = 0.05
    cfg = config.defaults(all_specs())
    defaults = cfg.checks[clock_events.CHECK_NAME]
    for key in ("window_s", "min_window_s", "max_gap_s"):
        defaults[key] = float(defaults[key]) * scale
    spec = replace(SPEC, quiet_rejudge_s=SPEC.quiet_rejudge_s * scale)
    d, store = one_check_daemon(scenario_copy("h100-hgx-healthy"), tmp_path, spec, cfg)
    d.opt.intervals[spec.name] = clock_events.INTERVAL_S * scale
    d.start()
    try:
        wait_for(lambda: d.results().get(spec.name) and d.results()[spec.name].state.get("gpus"), what="a reading")
        began = time.monotonic()
        time.sleep(6 * (SPEC.quiet_rejudge_s + clock_events.INTERVAL_S) * scale)
        state = d.results()[spec.name].state
        waited = time.monotonic() - began
    finally:
        d.stop()
        store.close()
    for gpu in state["gpus"].values():
        observed = sum(b["obs"] for b in gpu["buckets"])
        # Everything since the first reading was watched, up to the last judgement (at most one re-judge back).
        assert observed >= waited - (SPEC.quiet_rejudge_s + 2 * clock_events.INTERVAL_S) * scale, (observed, waited)


def test_a_quiet_recheck_comes_back_within_the_unobserved_gap():
    """The production values themselves: the re-judge of a quiet GPU (the first tick past quiet_rejudge_s, at most
    one interval later) comes seconds before max_gap_s, so a tick a little late still counts its stretch."""
    assert SPEC.quiet_rejudge_s + clock_events.INTERVAL_S <= SPEC.defaults["max_gap_s"] - 5.0


def test_only_judged_reasons_make_a_change_that_is_written_at_once(scenario_copy):
    """durable(): idle GPUs (gpu_idle, not judged) observed for minutes change nothing that must be written; a judged
    reason coming on does, and so does every reading while it is on."""
    root = scenario_copy("h100-hgx-healthy")
    set_masks(root, {i: IDLE for i in range(8)})
    d = Drive(root)
    d.run(15)
    idle = clock_events.durable(d.state)
    d.run(150)  # new buckets; observed and idle time grow
    assert clock_events.durable(d.state) == idle
    set_masks(root, {4: BRAKE})
    d.node = Node.recorded_at(root)
    d.tick()
    braking = clock_events.durable(d.state)
    assert braking != idle
    d.tick()
    assert clock_events.durable(d.state) != braking, "each reading with a judged reason on adds its active time"
