"""Clock-event (throttle) reasons per GPU, judged as the fraction of time each reason was active over a sliding
window (not one sample): HW slowdown, HW thermal slowdown, HW power brake, and SW thermal slowdown."""
from __future__ import annotations

import math
from typing import Any, Mapping

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass

CHECK_NAME = "clock_events"

# The bits of nvmlDeviceGetCurrentClocksEventReasons (nvml.h nvmlClocksEventReasons; pynvml names them
# nvmlClocksEventReason<Name>, and the deprecated nvmlClocksThrottleReason<Name> aliases carry the same values).
# tests/test_clock_events.py compares this table with the installed pynvml's constants.
REASONS: dict[str, int] = {
    "gpu_idle": 0x1,  # nvmlClocksEventReasonGpuIdle
    "applications_clocks_setting": 0x2,  # nvmlClocksEventReasonApplicationsClocksSetting
    "sw_power_cap": 0x4,  # nvmlClocksEventReasonSwPowerCap
    "hw_slowdown": 0x8,  # nvmlClocksEventReasonHwSlowdown (usually, not always, set with 0x40 or 0x80)
    "sync_boost": 0x10,  # nvmlClocksEventReasonSyncBoost
    "sw_thermal_slowdown": 0x20,  # nvmlClocksEventReasonSwThermalSlowdown
    "hw_thermal_slowdown": 0x40,  # nvmlClocksEventReasonHwThermalSlowdown
    "hw_power_brake_slowdown": 0x80,  # nvmlClocksEventReasonHwPowerBrakeSlowdown
    "display_clock_setting": 0x100,  # nvmlClocksEventReasonDisplayClockSetting
}
# Faults. Idle, application clocks, sync boost and display clocks are not; neither is the SW power cap: a power
# limit is policy (the GPU runs at the power it was allowed), not a fault of the node.
# The specific HW causes come first: the umbrella hw_slowdown is reported only when they do not explain it.
HW_REASONS = ("hw_thermal_slowdown", "hw_power_brake_slowdown", "hw_slowdown")
JUDGED = HW_REASONS + ("sw_thermal_slowdown",)
JUDGED_MASK = sum(REASONS[r] for r in JUDGED)
WHY = {  # what the reason means, and what to do when it is frequent enough to FAIL
    "hw_thermal_slowdown": ("HW thermal slowdown (clocks cut by half or more to protect an overheating GPU)",
                            "cooling is failing; drain and inspect the cooling"),
    "hw_power_brake_slowdown": ("HW power brake slowdown (the board's power-brake signal cut clocks by half or more)",
                                "a power supply or power delivery fault; drain and inspect power"),
    "hw_slowdown": ("HW slowdown (clocks cut by half or more), not explained by a thermal or power-brake event",
                    "drain and inspect the board"),
    "sw_thermal_slowdown": ("SW thermal slowdown (the driver holds clocks down to stay under the GPU or memory max "
                            "operating temperature)", "cooling is marginal"),
}
BUCKETS = 30  # per GPU: the window is kept as this many buckets of time-weighted seconds (bounded state)
INTERVAL_S = 10.0  # 30 readings per 300 s window; a reason held a tenth of the window is still ~3 readings


@dataclass(frozen=True)
class ClockSample:
    readings: tuple[tuple[Entity, int], ...]  # (GPU, clocks-event-reasons bitmask)
    problems: tuple[Finding, ...]  # GPUs NVML could not read (lost -> FAIL, other errors -> UNKNOWN)


def active_reasons(mask: int) -> list[str]:
    return [name for name, bit in REASONS.items() if mask & bit]


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> ClockSample:
    readings, problems = read_each_gpu(node, CHECK_NAME, node.nvml.clocks_event_reasons)
    return ClockSample(tuple((gpu.entity, int(mask)) for gpu, mask in readings), tuple(problems))


def advance(gpu_state: Mapping[str, Any], mask: int, now: float, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU's window after one reading: the time since the previous reading is credited to the reasons active
    now. The first reading, and one after a gap longer than max_gap_s, credit nothing (that time is unobserved)."""
    window_s = float(cfg["window_s"])
    width = max(window_s / BUCKETS, 1.0)
    buckets = [dict(b) for b in gpu_state.get("buckets", []) if b["t"] + width > now - window_s]
    last = gpu_state.get("last_t")
    dt = now - last if last is not None else 0.0
    if 0.0 < dt <= float(cfg["max_gap_s"]):
        start = math.floor(now / width) * width
        if not buckets or buckets[-1]["t"] != start:
            buckets.append({"t": start, "obs": 0.0, "on": {}})
        bucket = buckets[-1]
        bucket["obs"] += dt
        on = dict(bucket["on"])
        for reason in active_reasons(mask):
            on[reason] = on.get(reason, 0.0) + dt
        bucket["on"] = on
    # A clock that steps back re-anchors here (that interval credits nothing) rather than stalling the window.
    return {"last_t": now, "last_mask": mask, "buckets": buckets[-BUCKETS - 1:]}


def window_totals(gpu_state: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
    """Observed seconds in the window and the seconds each reason was active."""
    observed, active = 0.0, {name: 0.0 for name in REASONS}
    for b in gpu_state.get("buckets", []):
        observed += b["obs"]
        for reason, s in b["on"].items():
            if reason in active:
                active[reason] += s
    return observed, active


def decide(entity: Entity, observed: float, active: Mapping[str, float], mask: int,
           cfg: Mapping[str, Any]) -> list[Finding]:
    """Findings for one GPU from its window totals (pure)."""
    if observed < float(cfg["min_window_s"]) or observed <= 0:
        return []
    ratio = {r: active[r] / observed for r in REASONS}
    levels: dict[str, tuple[Status, Action]] = {}
    for r in HW_REASONS:
        if ratio[r] >= cfg["hw_fail_ratio"]:
            levels[r] = (Status.FAIL, Action.DRAIN)
        elif ratio[r] >= cfg["hw_warn_ratio"]:
            levels[r] = (Status.WARN, Action.MONITOR)
    if ratio["sw_thermal_slowdown"] >= cfg["sw_thermal_warn_ratio"]:
        levels["sw_thermal_slowdown"] = (Status.WARN, Action.MONITOR)
    umbrella = levels.get("hw_slowdown")
    if umbrella and any(levels.get(r, (Status.OK,))[0].rank >= umbrella[0].rank for r in HW_REASONS[:2]):
        del levels["hw_slowdown"]  # the thermal or power-brake finding already says why
    evidence = {"window_s": float(cfg["window_s"]), "observed_s": round(observed, 1),
                "ratio": {r: round(ratio[r], 4) for r in JUDGED},
                "active_s": {r: round(active[r], 1) for r in JUDGED},
                "active_now": active_reasons(mask), "clocks_event_reasons": hex(mask)}
    out = []
    for r in JUDGED:
        if r in levels:
            status, action = levels[r]
            what, advice = WHY[r]
            if status is Status.WARN and r != "sw_thermal_slowdown":
                advice = f"below the {cfg['hw_fail_ratio']:.0%} that drains; watch it"
            out.append(Finding(CHECK_NAME, r.replace("_", "-"), entity, status,
                               f"{entity.label()}: {ratio[r]:.1%} of the last {observed:.0f} s in {what}: {advice}",
                               action, {**evidence, "reason": r}))
    return out


def _metrics(entity: Entity, observed: float, active: Mapping[str, float], mask: int) -> list[MetricSample]:
    labels = {"gpu": str(entity.index), "uuid": entity.id}
    out = [MetricSample("gpuwarden_gpu_clock_event_active",
                        "Whether the clock-event (throttle) reason is active on the GPU now (1) or not (0).",
                        {**labels, "reason": r}, float(bool(mask & bit))) for r, bit in REASONS.items()]
    if observed > 0:
        out += [MetricSample("gpuwarden_gpu_clock_event_ratio",
                             "Fraction of the observed time in the window that the clock-event reason was active.",
                             {**labels, "reason": r}, active[r] / observed) for r in REASONS]
    return out


def judge(state: Mapping[str, Any], sample: ClockSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    old = state.get("gpus", {})
    gpus: dict[str, Any] = {}
    findings: list[Finding] = list(sample.problems)
    metrics: list[MetricSample] = []
    for entity, mask in sample.readings:
        gs = gpus[entity.id] = advance(old.get(entity.id, {}), mask, now, cfg)
        observed, active = window_totals(gs)
        findings += decide(entity, observed, active, mask, cfg)
        metrics += _metrics(entity, observed, active, mask)
    for key, gs in old.items():  # a GPU not read now (lost) keeps its window until it ages out
        if key not in gpus and gs.get("last_t", 0.0) > now - float(cfg["window_s"]):
            gpus[key] = gs
    return Judgement({"gpus": gpus}, tuple(findings), tuple(metrics))


def durable(state: Mapping[str, Any]) -> dict[str, Any]:
    """The part of the state written at once: the judged reasons each GPU is in now and the seconds each was active
    per bucket. Time observed while none is active (and the time of the last reading, and the reasons that are not
    judged) is written with the next such change or at stop: an idle node does not write its disk at every
    re-judge, and a kill -9 loses that time as unobserved, as it loses the time the daemon was down (the window's
    ratios are then those of the last change, never higher)."""
    def active(bucket: Mapping[str, Any]) -> dict[str, float]:
        return {r: s for r, s in bucket["on"].items() if r in JUDGED}

    return {key: (int(g.get("last_mask", 0)) & JUDGED_MASK,
                  [(b["t"], on) for b in g.get("buckets", ()) if (on := active(b))])
            for key, g in state.get("gpus", {}).items()}


def quiet(state: Mapping[str, Any]) -> bool:
    """No judged reason active at the last reading: the same readings again only add unthrottled time. Reasons that
    are not judged (an idle GPU's gpu_idle, a power cap) do not count: the same readings again cannot make a finding
    of them. A GPU read only once is not quiet: its second reading gives the window its first observed time (and the
    ratios their first value)."""
    gpus = state.get("gpus", {}).values()
    return all(g.get("buckets") for g in gpus) and not any(
        r in JUDGED for g in gpus for r in active_reasons(int(g.get("last_mask", 0))))


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="Clock-event reasons per GPU: time fraction in HW slowdown, HW thermal, power brake, SW thermal",
    sample=sample,
    judge=judge,
    interval_s=INTERVAL_S,
    defaults={
        "window_s": 300.0,  # sliding window the fractions are taken over
        "min_window_s": 60.0,  # observed seconds needed before judging (metrics are exported before)
        "max_gap_s": 30.0,  # a longer gap between two readings is unobserved time, credited to no reason
        # A HW slowdown cuts clocks by half or more, so a GPU in it a fifth of the time loses >= 10 % of its
        # throughput, and a synchronous job runs at the pace of its slowest GPU.
        "hw_fail_ratio": 0.2,
        # Just above one reading at the default interval and window (10 s / 300 s = 3.3 %): a single glitch does
        # not warn, a repeat does.
        "hw_warn_ratio": 0.04,
        "sw_thermal_warn_ratio": 0.1,  # the GPU regulating itself works as designed: WARN only
    },
    timeout_s=10.0,
    durable=durable,
    quiet=quiet,
    # The judgement after a skipped stretch credits it to the reasons of the (identical) sample, which is right only
    # while that stretch counts as observed: it must come back well within max_gap_s. It comes at the first tick past
    # this (ticks every interval), so this plus one interval plus the judge's own delay must stay under max_gap_s:
    # 15 + 10 = 25 s at most (the 20 s tick in practice) against 30. (25 s here came back at the 30 s tick, a few ms
    # past max_gap_s: a quiet GPU's window was never credited, and a later slowdown was judged against its own
    # minutes alone.)
    quiet_rejudge_s=15.0,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="clock_events", order=160, level=None, poll="SPEC", poll_order=2,
)
