"""GPU core and HBM temperatures: absolute limits (the configured ones, else each GPU's own as its driver reports them,
else the SKU table's), and the HBM-over-core gradient against the node's other GPUs (a cooling fault on a
liquid-cooled tray shows as one GPU's growing gap), each only when sustained."""
from __future__ import annotations

from dataclasses import field
from typing import Any, Mapping

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.thresholds import threshold

CHECK_NAME = "thermal"
LIMIT_KEYS = ("gpu_max_c", "memory_max_c")  # checks/data/thresholds/thermal.toml, or [checks.thermal]
# What each GPU reports of LIMIT_KEYS (Nvml.temperature_thresholds): NVML_TEMPERATURE_THRESHOLD_GPU_MAX, "GPU
# Temperature at which the GPU can be throttled below base clock", and _MEM_MAX, "Memory Temperature at which the GPU
# will begin SW slowdown" (nvml.h); nvidia-smi -q prints them as "GPU / Memory Max Operating Temp".
DEVICE_KEYS = {"gpu_max_c": "gpu_max", "memory_max_c": "mem_max"}
MIN_GPUS_FOR_MEDIAN = 3  # with two GPUs, each is as far from the median as the other: no outlier to name
INTERVAL_S = 10.0


@dataclass(frozen=True)
class ThermalSample:
    hostname: str
    sku: str
    limits: Mapping[str, float | None]  # LIMIT_KEYS: configured, else the SKU table, else None
    readings: tuple[tuple[Entity, int, int | None], ...]  # (GPU, core C, HBM C or None when NVML has no sensor)
    problems: tuple[Finding, ...]  # GPUs NVML could not read
    # GPU id -> LIMIT_KEYS -> what that GPU's driver reports (None: it reports none); a GPU absent: not read.
    device_limits: Mapping[str, Mapping[str, float | None]] = field(default_factory=dict)
    configured: frozenset[str] = frozenset()  # LIMIT_KEYS set in [checks.thermal]: they win over the GPU's own


def _device_limits(node: Any, gpu: Any) -> dict[str, float | None] | None:
    """LIMIT_KEYS as the GPU reports them; None when NVML failed to say (asked again at the next sample)."""
    try:
        reported = node.nvml.temperature_thresholds(gpu)
    except NvmlError:
        return None
    return {k: None if reported.get(name) is None else float(reported[name]) for k, name in DEVICE_KEYS.items()}


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> ThermalSample:
    readings, problems = read_each_gpu(node, CHECK_NAME, node.nvml.temperatures)
    limits = {k: threshold(CHECK_NAME, k, node.info.sku, cfg) for k in LIMIT_KEYS}
    configured = frozenset(k for k in LIMIT_KEYS if (cfg.get(k) or 0) > 0)
    # A GPU's limits do not change while its driver runs: read once per GPU, then kept in the check's state.
    known = state.get("device_limits", {})
    device: dict[str, Mapping[str, float | None]] = {}
    if configured != frozenset(LIMIT_KEYS):
        for gpu, _ in readings:
            got = known.get(gpu.entity.id) or _device_limits(node, gpu)
            if got is not None:
                device[gpu.entity.id] = got
    return ThermalSample(node.hostname, node.info.sku, limits,
                         tuple((gpu.entity, t["gpu"], t["memory"]) for gpu, t in readings), tuple(problems),
                         device, configured)


def gpu_limits(s: ThermalSample, gpu_id: str) -> tuple[dict[str, float | None], dict[str, str]]:
    """One GPU's limits and where each came from: "config", else "gpu" (its driver's own), else "sku-table"."""
    limits: dict[str, float | None] = {}
    sources: dict[str, str] = {}
    own = s.device_limits.get(gpu_id, {})
    for key in LIMIT_KEYS:
        if key in s.configured:
            limits[key], sources[key] = s.limits[key], "config"
        elif own.get(key) is not None:
            limits[key], sources[key] = own[key], "gpu"
        else:
            limits[key], sources[key] = s.limits[key], "sku-table" if s.limits[key] is not None else ""
    return limits, sources


def conditions(core: int, mem: int | None, median: float | None, limits: Mapping[str, float | None],
               cfg: Mapping[str, Any]) -> dict[str, float]:
    """What holds for one GPU now: condition name -> the value that makes it hold."""
    out: dict[str, float] = {}
    margin = float(cfg["limit_margin_c"])
    for sensor, value, limit in (("gpu", core, limits["gpu_max_c"]), ("memory", mem, limits["memory_max_c"])):
        if value is not None and limit is not None:
            if value >= limit:
                out[f"{sensor}_over"] = value
            if value >= limit - margin:
                out[f"{sensor}_near"] = value
    if mem is not None:
        gradient = mem - core
        if cfg["gradient_max_c"] > 0 and gradient > cfg["gradient_max_c"]:
            out["gradient_high"] = gradient
        if cfg["gradient_outlier_c"] > 0 and median is not None and gradient - median > cfg["gradient_outlier_c"]:
            out["gradient_outlier"] = gradient
    return out


def track(runs: Mapping[str, Any], holding: Mapping[str, float], now: float) -> dict[str, Any]:
    """Each condition's current run: since when it has held without a break, and its peak value."""
    out = {}
    for name, value in holding.items():
        run = runs.get(name)
        out[name] = {"since": run["since"], "peak": max(run["peak"], value)} if run else {"since": now, "peak": value}
    return out


def _finding(entity: Entity, code: str, status: Status, action: Action, msg: str, run: Mapping[str, Any],
             now: float, evidence: Mapping[str, Any]) -> Finding:
    return Finding(CHECK_NAME, code, entity, status, f"{entity.label()}: {msg} for {now - run['since']:.0f} s",
                   action, {**evidence, "since": run["since"], "sustained_s": round(now - run["since"], 1),
                            "peak": run["peak"]})


def decide(entity: Entity, core: int, mem: int | None, median: float | None, runs: Mapping[str, Any],
           limits: Mapping[str, float | None], cfg: Mapping[str, Any], now: float,
           sources: Mapping[str, str] | None = None) -> list[Finding]:
    """Findings for one GPU: the conditions that have held for sustain_s (pure)."""
    held = {k: r for k, r in runs.items() if now - r["since"] >= float(cfg["sustain_s"])}
    evidence = {"gpu_c": core, "memory_c": mem, "gradient_c": None if mem is None else mem - core,
                "node_median_gradient_c": median, "sustain_s": float(cfg["sustain_s"])}
    out = []
    for sensor, name, value in (("gpu", "GPU core", core), ("memory", "HBM", mem)):
        limit = limits[f"{sensor}_max_c"]
        code = "gpu" if sensor == "gpu" else "hbm"
        if f"{sensor}_over" in held:
            out.append(_finding(entity, f"{code}-over-temperature", Status.FAIL, Action.DRAIN,
                                f"{name} at {value} C, at or over its max operating {limit:g} C (where the GPU slows "
                                "itself down); cooling cannot hold it: drain and inspect the cooling",
                                held[f"{sensor}_over"], now,
                                {**evidence, "limit_c": limit, "limit_source": (sources or {}).get(f"{sensor}_max_c")}))
        elif f"{sensor}_near" in held:
            out.append(_finding(entity, f"{code}-temperature-near-limit", Status.WARN, Action.MONITOR,
                                f"{name} at {value} C, within {cfg['limit_margin_c']:g} C of its max operating "
                                f"{limit:g} C", held[f"{sensor}_near"], now,
                                {**evidence, "limit_c": limit, "limit_source": (sources or {}).get(f"{sensor}_max_c")}))
    if "gradient_high" in held:
        out.append(_finding(entity, "hbm-gradient-high", Status.WARN, Action.MONITOR,
                            f"HBM runs {mem - core} C above the core (over {cfg['gradient_max_c']:g} C): a cooling "
                            "fault on the HBM side (cold plate, flow, thermal interface)", held["gradient_high"], now,
                            {**evidence, "gradient_max_c": float(cfg["gradient_max_c"])}))
    elif "gradient_outlier" in held:
        out.append(_finding(entity, "hbm-gradient-outlier", Status.WARN, Action.MONITOR,
                            f"HBM runs {mem - core} C above the core, {mem - core - median:.0f} C more than the "
                            f"node's median of {median:g} C: a cooling fault on this GPU", held["gradient_outlier"],
                            now, {**evidence, "gradient_outlier_c": float(cfg["gradient_outlier_c"])}))
    return out


def _metrics(entity: Entity, core: int, mem: int | None) -> list[MetricSample]:
    labels = {"gpu": str(entity.index), "uuid": entity.id}
    name, help_t = "gpuwarden_gpu_temperature_celsius", "GPU temperature by sensor (gpu core, memory = HBM) in Celsius."
    out = [MetricSample(name, help_t, {**labels, "sensor": "gpu"}, float(core))]
    if mem is not None:
        out.append(MetricSample(name, help_t, {**labels, "sensor": "memory"}, float(mem)))
        out.append(MetricSample("gpuwarden_gpu_hbm_gradient_celsius",
                                "HBM temperature minus GPU core temperature in degrees Celsius.", labels,
                                float(mem - core)))
    return out


def _notes(s: ThermalSample) -> list[Finding]:
    """What was not judged, said once per node (status OK: a note, never a fault, never silent)."""
    here, out = Entity.node(s.hostname), []
    lacking: dict[str, list[int | None]] = {}
    for entity, _, _ in s.readings:
        limits, _ = gpu_limits(s, entity.id)
        for key in LIMIT_KEYS:
            if limits[key] is None:
                lacking.setdefault(key, []).append(entity.index)
    if lacking:
        unknown = [k for k in LIMIT_KEYS if k in lacking]
        gpus = sorted({i for idx in lacking.values() for i in idx if i is not None})
        out.append(Finding(CHECK_NAME, "thermal-limits-not-checked", here, Status.OK,
                           f"absolute temperature limits not judged: no {' or '.join(unknown)} for GPU "
                           f"{', '.join(map(str, gpus))}: the GPU's driver reports none (NVML temperature "
                           f"thresholds) and the SKU table has none for {s.sku} (set them in [checks.thermal])",
                           Action.NONE, {"sku": s.sku, "missing": unknown, "gpus": gpus}))
    no_hbm = [e for e, _, mem in s.readings if mem is None]
    if no_hbm:
        out.append(Finding(CHECK_NAME, "hbm-temp-unavailable", here, Status.OK,
                           f"NVML reports no HBM temperature for {', '.join(e.label() for e in no_hbm)}: judged on "
                           "the core temperature only (no HBM limit, no gradient)", Action.NONE,
                           {"gpus": [e.index for e in no_hbm]}))
    return out


def judge(state: Mapping[str, Any], sample: ThermalSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    old = state.get("gpus", {})
    gradients = [mem - core for _, core, mem in sample.readings if mem is not None]
    median = _median(gradients) if len(gradients) >= MIN_GPUS_FOR_MEDIAN else None
    gpus: dict[str, Any] = {}
    findings: list[Finding] = list(sample.problems) + _notes(sample)
    metrics: list[MetricSample] = []
    for entity, core, mem in sample.readings:
        prev = old.get(entity.id, {})
        # A gap in sampling longer than sustain_s breaks every run: nobody saw it hold across the gap.
        runs = prev.get("runs", {}) if now - prev.get("last_t", now) <= float(cfg["sustain_s"]) else {}
        limits, sources = gpu_limits(sample, entity.id)
        runs = track(runs, conditions(core, mem, median, limits, cfg), now)
        gpus[entity.id] = {"last_t": now, "runs": runs}
        findings += decide(entity, core, mem, median, runs, limits, cfg, now, sources)
        metrics += _metrics(entity, core, mem)
    new_state: dict[str, Any] = {"gpus": gpus}
    if sample.device_limits:
        new_state["device_limits"] = {k: dict(v) for k, v in sample.device_limits.items()}
    return Judgement(new_state, tuple(findings), tuple(metrics))


def _median(values: list[int]) -> float:
    # statistics.median, without importing statistics (fractions, decimal) into the daemon for one median
    ordered, mid = sorted(values), len(values) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def durable(state: Mapping[str, Any]) -> dict[str, Any]:
    """The runs of conditions, not the time of the last reading: while nothing holds, that time is all a reading
    changes, and losing it to a kill -9 only means a run that starts after the restart starts afresh."""
    return {gpu: g.get("runs", {}) for gpu, g in state.get("gpus", {}).items()}


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="GPU core and HBM temperatures against their limits, and the HBM gradient against the node's GPUs",
    sample=sample,
    judge=judge,
    interval_s=INTERVAL_S,
    defaults={
        "gpu_max_c": 0.0,  # 0 = the GPU's own (NVML), else the SKU table (thermal.toml): its max operating temperature
        "memory_max_c": 0.0,  # 0 = the GPU's own, else the SKU table: the HBM's max operating temperature
        "limit_margin_c": 5.0,  # WARN this close to a limit
        # Healthy H100 SXM (air) idles with HBM 7-10 C above the core (gpud's nvidia-smi -q captures of 16 GPUs).
        "gradient_outlier_c": 10.0,  # WARN when a GPU's gradient exceeds the node's median by more (0 = off)
        "gradient_max_c": 25.0,  # WARN when a GPU's gradient exceeds this, whatever the other GPUs do (0 = off)
        "sustain_s": 60.0,  # a condition must hold this long (every reading) before it is a finding
    },
    timeout_s=10.0,
    durable=durable,
    # No condition holding: the same temperatures judged again change only the time of the last reading, and
    # nothing in the state runs on time (a run breaks after sustain_s without a reading, but there is none). New
    # temperatures are judged at once; the same ones again only every quiet_rejudge_s.
    quiet=lambda state: not any(g.get("runs") for g in state.get("gpus", {}).values()),
    quiet_rejudge_s=300.0,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="thermal", order=170, level=None, poll="SPEC", poll_order=3,
)
